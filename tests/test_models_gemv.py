"""The few-row linear kernel against torch: awkward shapes, the fused SiLU*mul input, float32 output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchkv.errors import ContractError
from batchkv.models import build_model
from batchkv.models.fused import silu_mul_torch
from batchkv.models.gemv import GEMV_MAX_ROWS, GemvConfig, gemv, linear
from tests.model_loop import greedy_through_cache, make_cache, run_step, text_idx

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 16), (3, 17, 300), (16, 100, 64), (2, 33, 257)])
def test_gemv_matches_a_double_precision_matmul(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    got = gemv(x, w, config=GemvConfig(block_n=16, block_k=128))
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32: IEEE dots, not tf32
    torch.testing.assert_close(got.double(), expected(x, w).double(), atol=tol, rtol=tol)


def test_gemv_rounds_to_the_input_dtype_before_a_wider_output():
    x = torch.randn(2, 64, dtype=torch.float16, device=DEVICE)
    w = torch.randn(40, 64, dtype=torch.float16, device=DEVICE)
    got = gemv(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, got.half().float())  # every value is an fp16 value
    torch.testing.assert_close(got, expected(x, w).float(), atol=2e-2, rtol=2e-2)


def test_linear_falls_back_to_torch_off_cuda_or_past_the_row_limit():
    x = torch.randn(8, 2 * 32)
    w = torch.randn(24, 32)
    torch.testing.assert_close(linear(x, w, silu_mul=True), F.linear(silu_mul_torch(x), w))
    torch.testing.assert_close(linear(x[:, :32], w, out_dtype=torch.float64), F.linear(x[:, :32], w).double())


@pytest.mark.parametrize(("x_shape", "w_shape"), [((17, 32), (8, 32)), ((2, 32), (8, 31)), ((0, 32), (8, 32))])
def test_gemv_refuses_shapes_it_cannot_run(x_shape, w_shape):
    with pytest.raises(ContractError):
        gemv(torch.zeros(x_shape), torch.zeros(w_shape))


def test_gemv_refuses_mixed_dtypes():
    with pytest.raises(ContractError):
        gemv(torch.zeros(1, 32), torch.zeros(8, 32, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_at_the_8b_shapes_in_bf16(n, k, m):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    got = gemv(x, w, out_dtype=torch.float32)
    want = F.linear(x, w).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def _decode(model, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of one sequence decoded one row at a time, and its first decode step's logits."""
    tokens = greedy_through_cache(model, [[5, 9, 11, 3, 7]], [steps], bucket=1)[0]
    cache = make_cache(model, max_seqs=1)
    seq = cache.seq_new()
    run_step(model, cache, [(seq, [5, 9, 11, 3, 7], text_idx(0, 5))], 5)
    return tokens, run_step(model, cache, [(seq, [tokens[0]], text_idx(5, 1))], 1)


def test_the_tiny_model_decodes_the_same_tokens_through_the_few_row_kernel(monkeypatch):
    import batchkv.models.sensenova as sensenova

    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    plain_tokens, plain_logits = _decode(model, 6)

    def kernel_for_few_rows(x, w, *, silu_mul=False, out_dtype=None):  # the CUDA dispatch, on the CPU
        if silu_mul:
            x = silu_mul_torch(x)
        if x.shape[0] <= GEMV_MAX_ROWS:
            return gemv(x, w, out_dtype=out_dtype)
        return linear(x, w, out_dtype=out_dtype)

    monkeypatch.setattr(sensenova, "linear", kernel_for_few_rows)
    tokens, logits = _decode(model, 6)
    assert tokens == plain_tokens
    torch.testing.assert_close(logits, plain_logits, atol=1e-4, rtol=1e-4)


def _teacher_forced(model, tokens: list[int]) -> torch.Tensor:
    """float32 [len(tokens), vocab]: next-token logits after each token, decoded one row at a time."""
    cache = make_cache(model, max_seqs=1, capacity=len(tokens) + 8)
    seq = cache.seq_new()
    return torch.cat([run_step(model, cache, [(seq, [t], text_idx(i, 1))], 1) for i, t in enumerate(tokens)])


@pytest.mark.gpu
def test_bf16_decode_agrees_with_cublas_over_256_steps(monkeypatch):
    """Greedy decode with the kernel, then both paths teacher-forced on its tokens: every step's
    argmax agrees wherever cuBLAS's top two logits are further apart than the paths differ (bf16
    sums in another order may swap a near tie; a random tiny model has some), and the logits agree
    within bf16 tolerance."""
    import batchkv.models.gemv as gemv_module

    model = build_model("sensenova-u1-tiny", "cuda", dtype=torch.bfloat16, seed=0)
    prompt = [5, 9, 11, 3, 7]
    tokens = greedy_through_cache(model, [prompt], [256], bucket=1, capacity=len(prompt) + 256)[0]
    seq = prompt + tokens[:-1]
    kernel = _teacher_forced(model, seq)
    monkeypatch.setattr(gemv_module, "GEMV_MAX_ROWS", 0)  # every matmul through cuBLAS
    cublas = _teacher_forced(model, seq)
    torch.testing.assert_close(kernel, cublas, atol=0.1, rtol=0.05)
    gap = (kernel - cublas).abs().max(-1).values
    top2 = cublas.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * gap
    assert clear.sum() >= 0.5 * len(seq)  # the check is not vacuous: most steps are clear
    assert torch.equal(kernel.argmax(-1)[clear], cublas.argmax(-1)[clear])
