"""`batchkv serve`'s per-device --max-seqs default: the store sized to the GPU (256 sequences), a
few sequences on the CPU, where "auto" would allocate most of the host's memory; a given number
is kept on either."""

from __future__ import annotations

import argparse

import pytest

from batchkv.cli.options import CPU_MAX_SEQS, scheduling_kwargs
from batchkv.cli.serve import add_arguments


@pytest.fixture(scope="module")
def parser():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_serving_sizes_the_store_to_a_gpu_and_takes_a_few_sequences_on_the_cpu(parser):
    args = parser.parse_args(["--model", "m"])
    assert args.max_seqs is None
    assert scheduling_kwargs(args, "cuda")["max_seqs"] == "auto"
    assert scheduling_kwargs(args, "cpu")["max_seqs"] == CPU_MAX_SEQS == 16
    assert "auto on CUDA, 16 on the CPU" in " ".join(parser.format_help().split())  # as wrapped


@pytest.mark.parametrize("given, expected", [("8", 8), ("auto", "auto")])
def test_a_given_max_seqs_is_kept_on_every_device(parser, given, expected):
    args = parser.parse_args(["--model", "m", "--max-seqs", given])
    assert scheduling_kwargs(args, "cuda")["max_seqs"] == scheduling_kwargs(args, "cpu")["max_seqs"] == expected
