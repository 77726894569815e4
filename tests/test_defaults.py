"""One set of step defaults for Engine, `batchkv run` and `batchkv serve`, and help without
contradictions."""

from __future__ import annotations

import argparse

import pytest

from batchkv.executor import Engine
from batchkv.executor.sizing import DEFAULT_PREFILL_CHUNK, DEFAULT_STEP_TOKENS
from tests.toy_model import ToyModel


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    if command == "run":
        from batchkv.cli.run import add_run

        add_run(sub)
    else:
        from batchkv.cli.serve import add_serve

        add_serve(sub)
    return sub.choices[command]


def test_the_engine_takes_the_measured_serving_defaults_within_its_capacity():
    engine = Engine(ToyModel(), max_seqs=2, capacity=4096)
    assert (engine.scheduler.max_step_tokens, engine.scheduler.prefill_chunk) == (1024, 512)
    assert (DEFAULT_STEP_TOKENS, DEFAULT_PREFILL_CHUNK) == (1024, 512)
    small = Engine(ToyModel(), max_seqs=2, capacity=100)
    assert small.scheduler.prefill_chunk == 100  # the default chunk never exceeds the capacity


@pytest.mark.parametrize("command", ["run", "serve"])
def test_run_and_serve_default_to_the_engines_step_budget_and_chunk(command):
    args = _parser(command).parse_args(["--model", "sensenova-u1-tiny"])
    assert args.max_step_tokens == "auto"  # the Engine's default budget for an 8B model and on the CPU
    engine = Engine(ToyModel(seed=0), max_step_tokens=args.max_step_tokens)
    assert engine.scheduler.max_step_tokens == DEFAULT_STEP_TOKENS
    assert args.prefill_chunk is None  # the Engine's default, within capacity and step budget


@pytest.mark.parametrize("command", ["run", "serve"])
def test_help_states_each_default_once(command):
    text = _parser(command).format_help()
    assert "(default: None)" not in text
    spec = " ".join(text.rsplit("--spec-block N", 1)[1].split("--spec-layers")[0].split())
    assert spec.count("default") == 1, spec
    capacity = " ".join(text.rsplit("--max-model-len N|auto", 1)[1].split("--max-step-tokens")[0].split())
    assert "256" not in capacity and capacity.count("default") == 1, capacity
