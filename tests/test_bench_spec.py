"""bench/spec.py's controlled acceptance holds where the GPU's numerics broke it: the tiny target in
bf16 with the few-row matmuls rounded differently from the many-row ones, so a one-row decode
and a verify segment disagree in their last bits, as the few-row kernel and cuBLAS do on CUDA."""

import pytest
import torch

from batchkv.models import build_model
from batchkv.models.fused import silu_mul_torch
from batchkv.models.gemv import GEMV_MAX_ROWS, linear
from bench import spec as bench_spec

ARGS = ["--preset", "sensenova-u1-tiny", "--device", "cpu", "--dtype", "bfloat16", "--new-tokens", "29",
        "--draft-layers", "1", "--budget-s", "1e9"]  # fmt: skip


@pytest.fixture
def few_rows_round_apart(monkeypatch, request):
    """`linear` at up to GEMV_MAX_ROWS rows as the CUDA dispatch sends it to the few-row kernel,
    emulated: float32 accumulation rounded to bf16 (the kernel's), each output then moved by one
    bf16 rounding step (x (1 +- 2^-8); an indirect parameter sets another step), so the two paths
    surely differ. (The Triton interpreter's bf16 dots are wrong, so the kernel itself cannot run
    here in bf16.)"""
    import batchkv.models.sensenova as sensenova

    step = getattr(request, "param", 2.0**-8)
    gen = torch.Generator().manual_seed(0)

    def few_rows(x, w, *, silu_mul=False, out_dtype=None):
        if silu_mul:
            x = silu_mul_torch(x)
        if x.shape[0] > GEMV_MAX_ROWS:
            return linear(x, w, out_dtype=out_dtype)
        y = x.float() @ w.float().T
        y = (y * (1 + step * (2 * torch.randint(0, 2, y.shape, generator=gen) - 1))).to(x.dtype)
        return y if out_dtype is None else y.to(out_dtype)

    monkeypatch.setattr(sensenova, "linear", few_rows)


def test_the_measured_acceptance_length_is_tau_in_bf16_when_decode_and_verify_round_apart(few_rows_round_apart):
    # 29 new tokens: 28 decode tokens, a multiple of every tau, so no run ends on a short block.
    args = bench_spec.parser().parse_args([*ARGS, "--batches", "1,4", "--taus", "1,2,4,7", "--fixed-taus", "1"])
    result = bench_spec.measure(args)
    assert result["dtype"] == "bfloat16"
    assert result["continuation_follows_succ"] == {"b1": 1.0, "b4": 1.0}
    assert [row["tau"] for row in result["spec"]] == [1, 2, 4, 7]
    for row in result["spec"] + result["spec_fixed"]:
        for b in ("b1", "b4"):
            assert row["accept_len_by_batch"][b] == pytest.approx(row["tau"], rel=0.03), (row, b)
    adaptive, fixed = result["spec"][0]["drafts_per_step"], result["spec_fixed"][0]["drafts_per_step"]
    assert adaptive["b1"] < 0.25 * fixed["b1"]  # nothing is accepted at tau 1: drafting mostly stops


@pytest.mark.parametrize("few_rows_round_apart", [2.0**-6], indirect=True)
def test_without_predictable_weights_the_control_does_not_hold(few_rows_round_apart):
    """The failure of the 2026-11-30 run, reproduced: the random target's near-ties flip between
    the two paths, so verify leaves the recorded continuation. The outputs move by four rounding
    steps here: the random target's top two logits are rarely within one step of each other (the
    CPU build of torch 2.13 on 2026-12-06 drew no flip in 57 tokens, and accepted every draft)."""
    args = bench_spec.parser().parse_args([*ARGS, "--batches", "1", "--taus", "7", "--fixed-taus", "", "--raw-target"])
    result = bench_spec.measure(args)
    assert result["spec"][0]["accept_len_mean"] < 6


def test_predictable_weights_keep_shapes_and_walk_one_cycle_through_the_vocabulary():
    model = build_model("sensenova-u1-tiny", "cpu", dtype=torch.bfloat16, seed=0)
    before = {name: (p.shape, p.dtype) for name, p in model.named_parameters()}
    embed = model.embed_tokens.clone()
    succ = bench_spec.predictable(model, seed=3)
    assert {name: (p.shape, p.dtype) for name, p in model.named_parameters()} == before
    walk, token = set(), 0
    for _ in range(model.vocab_size):
        walk.add(token)
        token = int(succ[token])
    assert len(walk) == model.vocab_size and token == 0
    torch.testing.assert_close(model.embed_tokens, (embed.float() * bench_spec.EMBED_SCALE).bfloat16())
    torch.testing.assert_close(model.lm_head[succ], (embed.float() * model.config.hidden**-0.5).bfloat16())
