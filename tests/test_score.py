"""`batchkv.score` and `batchkv score` on the real model: perplexity equals transformers' own loss,
identical storage agrees with itself, the command prints one row per file, and key rounding
calibrated on one text lowers e4m3's KL on another."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from batchkv import cli
from batchkv.errors import ConfigError
from batchkv.score import E4M3, calibrate_key_rounding, make_cache, score, score_caches
from tests.real_model import gguf_path, hf_model, threads, tokenizer

pytestmark = pytest.mark.slow
TOKENS = 130  # three 64-token chunks, the last one short


@pytest.fixture(scope="module")
def ids():
    gguf_path()
    text = (Path(__file__).parent / "fixtures" / "prose.txt").read_text()
    return tokenizer()(text).input_ids[:TOKENS]


def test_fp32_storage_perplexity_equals_transformers_loss_and_agrees_with_itself(ids):
    from batchkv.models.hf import HFModel

    with threads(), torch.no_grad():
        loss = float(hf_model()(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
        s = score(HFModel(hf_model()), ids, kv_dtype=torch.float32, reference_dtype=torch.float32)
    assert s.tokens == TOKENS - 1
    assert s.ppl == s.reference_ppl and s.top1_agreement == 1.0 and s.kl_mean == 0.0
    assert math.isclose(math.log(s.ppl), loss, rel_tol=1e-4)


def test_a_text_of_one_token_is_refused():
    from batchkv.models.hf import HFModel

    with pytest.raises(ConfigError):
        score(HFModel(hf_model()), [5])


def test_the_score_command_prints_a_row_per_file(capsys, tmp_path):
    path = gguf_path()
    text = tmp_path / "mine.txt"
    text.write_text("The lighthouse kept its light burning through the long winter nights. " * 4)
    code = cli.main(["score", "--model", str(path), str(text), "--device", "cpu", "--threads", "2",
                     "--max-tokens", "64", "--chunk", "32"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    row = out.strip().splitlines()[-1].split()
    assert row[0].endswith("mine.txt") and int(row[1]) > 30 and row[-2].endswith("%")


def test_key_rounding_calibrated_on_source_code_lowers_e4m3_kl_on_prose(ids):
    from batchkv.models.hf import HFModel

    model = HFModel(hf_model())
    source = tokenizer()((Path(__file__).parent / "fixtures" / "source.py.txt").read_text()).input_ids[:TOKENS]
    with threads():
        rounding = calibrate_key_rounding(model, source, key_rotation=True)
        tested = [make_cache(model, E4M3, len(ids), 64, key_rotation=True, key_rounding=r) for r in (None, rounding)]
        reference = make_cache(model, torch.bfloat16, len(ids), 64)
        rotated, rounded = score_caches(model, ids, tested, reference, 64)
    assert rounded.kl_mean < 0.8 * rotated.kl_mean


def test_calibrating_on_one_token_is_refused():
    from batchkv.models.hf import HFModel

    with pytest.raises(ConfigError):
        calibrate_key_rounding(HFModel(hf_model()), [5])
