"""Requests stop at the model's EOS ids by default (as vLLM and transformers `generate` do);
`ignore_eos=True` decodes past them; a model without EOS ids stops at stop_token_ids only."""

from __future__ import annotations

import pytest

from batchkv.errors import RequestError
from batchkv.executor import Engine, Request, SamplingParams, gather
from tests.toy_model import ToyModel, reference_generate

PROMPT = [5, 17, 33, 2, 9]
MAX_NEW = 12


@pytest.fixture(scope="module")
def plain():
    """The toy model's greedy continuation of PROMPT with no EOS at all (the oracle)."""
    tokens, reason = reference_generate(ToyModel(), PROMPT, MAX_NEW)
    assert reason == "length" and len(set(tokens[:4])) >= 2, "the prompt should continue with varied tokens"
    return tokens


def _generate(model, **params) -> tuple[list[int], str]:
    engine = Engine(model, max_seqs=2, capacity=64, max_step_tokens=16, prefill_chunk=8)
    engine.submit(Request(PROMPT, SamplingParams(max_new_tokens=MAX_NEW, **params)))
    out = gather(engine.run_until_done())[0]
    engine.assert_idle()
    return out.tokens[0], out.finish_reasons[0]


def _model_with_eos(eos: tuple[int, ...]) -> ToyModel:
    model = ToyModel()
    model.eos_token_ids = eos  # what HFModel exposes from its generation config
    return model


def test_a_request_stops_at_the_models_eos_by_default_and_emits_it(plain):
    eos = plain[3]
    first = plain.index(eos)
    tokens, reason = _generate(_model_with_eos((eos,)))
    assert (tokens, reason) == (plain[: first + 1], "stop")


def test_ignore_eos_decodes_past_the_models_eos(plain):
    tokens, reason = _generate(_model_with_eos((plain[3],)), ignore_eos=True)
    assert (tokens, reason) == (plain, "length")


def test_ignore_eos_keeps_the_requests_own_stop_ids(plain):
    stop = plain[5]
    tokens, reason = _generate(_model_with_eos((plain[1],)), ignore_eos=True, stop_token_ids=(stop,))
    assert (tokens, reason) == (plain[: plain.index(stop) + 1], "stop")


def test_a_model_without_eos_ids_decodes_to_max_new_tokens(plain):
    assert not hasattr(ToyModel(), "eos_token_ids")
    assert _generate(ToyModel()) == (plain, "length")


def test_the_preset_models_have_no_eos_ids():
    from batchkv.models import build_model

    engine = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), max_seqs=1, capacity=128)
    assert engine.eos_token_ids == ()


def test_ignore_eos_must_be_a_bool():
    with pytest.raises(RequestError):
        SamplingParams(ignore_eos=1)
