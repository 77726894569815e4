"""FP8 compute on the real model (SmolLM2-135M-Instruct, CPU): `batchkv score --quantization fp8`
prints what e4m3 projections cost against the same weights in the model dtype, K/V stored alike."""

from __future__ import annotations

import pytest

from batchkv import cli
from tests.real_model import gguf_path

pytestmark = pytest.mark.slow


def test_score_with_quantization_fp8_prints_perplexity_and_agreement_against_the_float_model(capsys, tmp_path):
    path = gguf_path()
    text = tmp_path / "mine.txt"
    text.write_text("The lighthouse kept its light burning through the long winter nights. " * 4)
    code = cli.main(["score", "--model", str(path), str(text), "--quantization", "fp8", "--device", "cpu",
                     "--threads", "2", "--max-tokens", "64", "--chunk", "32"])  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert "ppl fp8 bfloat16" in out[-2]  # the tested column: fp8 compute, K/V as the reference stores it
    row = out[-1].split()
    reference_ppl, ppl, agreement = float(row[2]), float(row[3]), float(row[5].rstrip("%"))
    assert ppl != reference_ppl and abs(ppl / reference_ppl - 1) < 0.1 and 70 < agreement <= 100
