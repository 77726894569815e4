"""`batchkv run --speculative`, and DFlash pair manifests: export, inspect, from_manifest."""

from __future__ import annotations

import json

import pytest
import torch

from batchkv import cli
from batchkv.cache import BatchedSequenceCache
from batchkv.errors import ManifestError
from batchkv.manifest import from_manifest
from batchkv.manifest.pair import CachePair, decode_pair


@pytest.mark.parametrize("method", ["ngram", "dflash"])
def test_run_with_speculation_prints_and_writes_its_metrics(tmp_path, capsys, method):
    torch.set_num_threads(1)
    out = tmp_path / "m.json"
    argv = ["run", "--device", "cpu", "--requests", "4", "--prompt-len", "4:16", "--output-len", "4:12"]
    assert cli.main([*argv, "--speculative", method, "--spec-block", "4", "--json", str(out)]) == 0
    assert "speculative" in capsys.readouterr().out
    metrics = json.loads(out.read_text())
    assert metrics["spec_proposed"] > 0 and 0 <= metrics["spec_accepted"] <= metrics["spec_proposed"]
    assert metrics["spec_accept_len_mean"] >= 1.0


def test_spec_flags_without_speculation_are_refused(capsys):
    assert cli.main(["run", "--device", "cpu", "--requests", "1", "--spec-block", "4"]) == 2
    assert "--speculative" in capsys.readouterr().err


def test_a_dflash_pair_exports_inspects_and_builds_both_caches(tmp_path, capsys):
    path = tmp_path / "pair.json"
    argv = ["export", "--preset", "sensenova-u1-8b", "--kv-layout", "batched-sequence", "--max-kv-seqs", "8"]
    assert cli.main([*argv, "--capacity", "4096", "--draft-layers", "5", "--spec-block", "16", "-o", str(path)]) == 0
    pair = decode_pair(path.read_bytes())
    assert pair.target.is_causal and not pair.drafter.is_causal
    assert (pair.drafter.num_layers, pair.drafter.max_seqs, pair.drafter.maximum_capacity) == (5, 8, 4096)
    assert pair.drafter.max_write >= pair.target.max_write + 16 - 1
    capsys.readouterr()
    assert cli.main(["inspect", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "block_size 16" in shown and "[target]" in shown and "[drafter]" in shown and "non-causal" in shown
    caches = from_manifest(path, "cpu", capacity=64, max_write=8, max_seqs=2, dtype="float32")
    assert isinstance(caches, CachePair)
    assert all(isinstance(c, BatchedSequenceCache) for c in caches)
    assert caches.drafter.config.num_layers == 5 and caches.drafter.config.max_write == 8 + 16
    assert caches.target.config.num_layers == 42


def test_a_pair_whose_drafter_is_causal_is_refused_with_its_path(tmp_path):
    path = tmp_path / "pair.json"
    argv = ["export", "--preset", "sensenova-u1-8b", "--kv-layout", "batched-sequence", "--capacity", "1024"]
    assert cli.main([*argv, "--draft-layers", "2", "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    data["drafter"]["causal"] = True
    with pytest.raises(ManifestError) as info:
        decode_pair(json.dumps(data).encode())
    assert info.value.path == "$.drafter.causal"
    data["drafter"]["causal"] = False
    data["drafter"]["max_write"] = 0
    with pytest.raises(ManifestError) as info:
        decode_pair(json.dumps(data).encode())
    assert info.value.path == "$.drafter.max_write"
