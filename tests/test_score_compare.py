"""`batchkv.score.compare_logprobs`: perplexity, top-1 agreement and KL of two whole texts' log-probabilities
against the float64 definitions (what `bench/fp8_accuracy.py` compares every model pair with)."""

from __future__ import annotations

import math

import pytest
import torch

from batchkv.errors import ConfigError
from batchkv.score import chunk_logprobs, compare_logprobs


def test_compare_logprobs_matches_the_float64_definitions():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(9, 13, generator=gen).log_softmax(-1)
    tested = (ref.exp() + 0.05 * torch.rand(9, 13, generator=gen)).log().log_softmax(-1)
    tested[3] = ref[3].roll(1)  # one position whose argmax surely moves
    target = torch.randint(0, 13, (9,), generator=gen)
    s = compare_logprobs(tested, ref, target, tested_name="fp8", reference_name="bf16")
    r64, t64 = ref.double(), tested.double()
    rows = range(9)
    nll = -sum(float(t64[i, target[i]]) for i in rows) / 9
    reference_nll = -sum(float(r64[i, target[i]]) for i in rows) / 9
    kls = [sum(math.exp(r64[i, v]) * float(r64[i, v] - t64[i, v]) for v in range(13)) for i in rows]
    agree = sum(int(torch.argmax(t64[i]) == torch.argmax(r64[i])) for i in rows) / 9
    assert (s.tokens, s.kv_dtype, s.reference_dtype) == (9, "fp8", "bf16")
    assert math.isclose(s.ppl, math.exp(nll), rel_tol=1e-6)
    assert math.isclose(s.reference_ppl, math.exp(reference_nll), rel_tol=1e-6)
    assert math.isclose(s.kl_mean, sum(kls) / 9, rel_tol=1e-4) and math.isclose(s.kl_max, max(kls), rel_tol=1e-4)
    assert s.top1_agreement == agree and agree < 1.0


def test_identical_log_probabilities_agree_everywhere_with_zero_kl():
    ref = torch.randn(5, 7).log_softmax(-1)
    s = compare_logprobs(ref, ref, torch.zeros(5, dtype=torch.int64))
    assert s.ppl == s.reference_ppl and s.top1_agreement == 1.0 and s.kl_mean == 0.0 and s.ppl_change == 0.0


def test_chunk_logprobs_refuses_a_text_of_one_token():
    with pytest.raises(ConfigError):
        chunk_logprobs(None, [5], None, 64)
