"""bench/lib/hf_cb.py: the transformers continuous-batching peer, driven on CPU with a tiny Qwen3.

Its tokens must be transformers' own greedy `generate` tokens, exactly `outputs[i]` of them (EOS
disabled), whether the requests come at once or at arrival times, with at most `max_inflight` live.
"""

import pytest
import torch

from bench.lib import hf_cb
from bench.lib.hf_baselines import qwen3_like

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [3, 3, 3, 3], [400, 2]]
OUTPUTS = [4, 6, 8, 5, 3]


@pytest.fixture(scope="module")
def tiny_qwen3():
    return qwen3_like(torch.device("cpu"), tiny=True, seed=0)


def greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)  # fmt: skip
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arrivals", [None, [0.0, 0.01, 0.02, 0.05, 0.05]])
def test_the_peer_generates_transformers_greedy_tokens_for_every_request(tiny_qwen3, arrivals):
    setting = {"attn": "sdpa", "graphs": False, "batch_tokens": 64, "compile": 0}
    run = hf_cb.serve(tiny_qwen3, setting, PROMPTS, OUTPUTS, arrivals, max_inflight=2, box_s=60, return_tokens=True)
    assert run["token_ids"] == [greedy(tiny_qwen3, p, o) for p, o in zip(PROMPTS, OUTPUTS, strict=True)]
    assert (run["finished"], run["tokens"], run["boxed"], run["no_first_token"]) == (5, sum(OUTPUTS), False, 0)
    assert run["ttft_p50_ms"] > 0 and run["itl_p50_ms"] > 0 and run["tokens_per_s"] > 0


def test_the_config_is_sized_like_batchkvs_cache_in_this_transformers_version():
    cfg = hf_cb.cb_config({"attn": "sdpa", "graphs": True, "batch_tokens": 512, "compile": 0}, 3000, 64)
    block = getattr(cfg, "page_size", None) or cfg.block_size
    assert (block, cfg.num_blocks, cfg.max_requests_per_batch, cfg.max_batch_tokens) == (256, 64 * 13, 64, 512)


def test_a_prefix_is_the_leading_requests_a_peer_finishes_in_most_of_its_box():
    outputs = [100, 200, 300, 400]
    assert hf_cb.prefix_fitting(outputs, tokens_per_s=10.0, box_s=50.0, least=1) == 2  # 400 tokens fit, 600 do not
    assert hf_cb.prefix_fitting(outputs, tokens_per_s=10.0, box_s=50.0, least=3) == 3
    assert hf_cb.prefix_fitting(outputs, tokens_per_s=1e6, box_s=50.0) == 4


def test_calibration_tries_only_the_settings_it_is_given(tiny_qwen3):
    """A resumed decode run calibrates only the candidates the first run skipped."""
    setting = {"attn": "sdpa", "graphs": False, "batch_tokens": 64, "compile": 0}
    best, tried = hf_cb.calibrate(tiny_qwen3, PROMPTS[:2], OUTPUTS[:2], budget_s=60, cap=2, settings=[setting])
    assert best == setting and [t["setting"] for t in tried] == [setting] and tried[0]["tokens_per_s"] > 0
