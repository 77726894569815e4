"""SenseNova-U1 through a BatchedSequenceCache against the eager single-sequence reference."""

from __future__ import annotations

import pytest
import torch

from batchkv.errors import ConfigError
from batchkv.models import MODEL_PRESETS, SenseNovaLM, build_model
from batchkv.models.reference import reference_generate, reference_logits
from batchkv.models.sensenova import rms_norm
from tests.model_loop import greedy_through_cache, make_cache, run_step, text_idx

TOL = {"atol": 2e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def model() -> SenseNovaLM:
    return build_model("sensenova-u1-tiny", "cpu", seed=0)


def _image_like_indexes(n: int, gen: torch.Generator) -> torch.Tensor:
    """(t, h, w) with repeated t and nonzero h/w, so every RoPE section is exercised."""
    t = torch.arange(n) // 3 + 5
    hw = torch.randint(0, 9, (2, n), generator=gen)
    return torch.cat([t[None], hw])


def test_packed_prefill_chunks_and_decodes_give_each_sequence_its_reference_logits(model):
    gen = torch.Generator().manual_seed(1)
    lengths = (13, 6, 9)
    tokens = [torch.randint(0, model.vocab_size, (n,), generator=gen) for n in lengths]
    indexes = [text_idx(0, 13), text_idx(7, 6), _image_like_indexes(9, gen)]  # t need not equal position
    # (seq, n tokens) runs in packed order; seq 0 appears in two runs of the third step.
    schedule = [
        [(0, 5), (1, 3), (2, 4)],
        [(1, 2), (0, 4), (2, 4)],
        [(0, 2), (2, 1), (1, 1), (0, 2)],
    ]
    cache = make_cache(model, max_seqs=3, max_write=8)
    ids = [cache.seq_new() for _ in lengths]
    got = [[] for _ in lengths]
    fed = [0, 0, 0]
    for step in schedule:
        chunks = []
        for s, n in step:
            sl = slice(fed[s], fed[s] + n)
            chunks.append((ids[s], tokens[s][sl].tolist(), indexes[s][:, sl]))
            fed[s] += n
        width = sum(n for _, n in step) + 3  # padding rows too
        logits = run_step(model, cache, chunks, width)
        row = 0
        for s, n in step:
            got[s].append(logits[row : row + n])
            row += n
    assert fed == list(lengths)
    for s in range(3):
        expected, _ = reference_logits(model, tokens[s], indexes[s])
        torch.testing.assert_close(torch.cat(got[s]), expected, **TOL)


def test_selected_logits_rows_equal_the_same_rows_of_a_full_selection(model):
    cache = make_cache(model, max_seqs=2)
    a, b = cache.seq_new(), cache.seq_new()
    chunks = [(a, [3, 1, 4, 1], text_idx(0, 4)), (b, [5, 9, 2], text_idx(0, 3))]
    full = run_step(model, cache, chunks, 8)
    cache.rewind(a, 0)
    cache.rewind(b, 0)
    picked = run_step(model, cache, chunks, 8, rows=[6, 3])
    torch.testing.assert_close(picked, full[[6, 3]], **TOL)


def test_reference_with_past_matches_the_reference_over_one_block(model):
    ids = torch.tensor([7, 3, 11, 2, 9, 4, 4, 1])
    idx = text_idx(0, 8)
    whole, _ = reference_logits(model, ids, idx)
    first, past = reference_logits(model, ids[:5], idx[:, :5])
    rest, past = reference_logits(model, ids[5:], idx[:, 5:], past)
    torch.testing.assert_close(torch.cat([first, rest]), whole, **TOL)
    assert past[0][0].shape == (model.config.kv_heads, 8, model.config.head_dim)


def test_greedy_generation_through_the_cache_equals_reference_generate(model):
    prompts = [[1, 2, 3], [10, 20, 30, 40, 50, 60, 70], list(range(100, 112))]
    max_new = [6, 10, 8]
    got = greedy_through_cache(model, prompts, max_new, max_write=8)
    for prompt, n, out in zip(prompts, max_new, got, strict=True):
        assert out == reference_generate(model, prompt, n)
    assert len({tuple(o) for o in got}) == 3  # the prompts really lead different ways


def test_a_stop_id_ends_generation_and_is_kept(model):
    full = reference_generate(model, [5, 6, 7], 8)
    stop = full[3]
    cut = reference_generate(model, [5, 6, 7], 8, stop_ids=[stop])
    assert cut == full[: full.index(stop) + 1]
    assert greedy_through_cache(model, [[5, 6, 7]], [8], stop_ids=[stop]) == [cut]


def test_the_same_seed_gives_the_same_weights_and_another_seed_does_not():
    a = build_model("sensenova-u1-tiny", seed=3)
    b = build_model("sensenova-u1-tiny", seed=3)
    c = build_model("sensenova-u1-tiny", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name


def test_an_unknown_preset_is_refused_with_the_known_names():
    with pytest.raises(ConfigError, match="sensenova-u1-tiny"):
        build_model("sensenova-u1-huge")


def test_the_8b_preset_caches_168_kib_per_token_and_has_about_9_billion_parameters():
    model = SenseNovaLM(MODEL_PRESETS["sensenova-u1-8b"], "meta")
    spec = model.cache_spec()
    per_token = 2 * spec["num_layers"] * spec["kv_heads"] * spec["head_dim"] * 2
    assert (spec["num_layers"], spec["kv_heads"], spec["head_dim"], spec["dtype"]) == (42, 8, 128, torch.bfloat16)
    assert per_token == 168 * 1024
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params
    assert 9.2e9 < model.config.num_params < 9.4e9


@pytest.mark.gpu
def test_a_cpu_drawn_init_is_identical_on_the_gpu():
    cpu = build_model("sensenova-u1-tiny", "cpu", seed=5)
    gpu = build_model("sensenova-u1-tiny", "cuda", seed=5, init_on="cpu")
    for pc, pg in zip(cpu.parameters(), gpu.parameters(), strict=True):
        assert torch.equal(pc, pg.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_exactly_like_transformers_qwen3_rmsnorm(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = Qwen3RMSNorm(64, eps=1e-6).to(dtype).requires_grad_(False)
    norm.weight.copy_(torch.randn(64, generator=gen))
    x = (3 * torch.randn(5, 7, 64, generator=gen)).to(dtype)
    assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))


def test_a_bfloat16_model_through_the_cache_stays_close_to_its_reference():
    model = build_model("sensenova-u1-tiny", dtype=torch.bfloat16, seed=0)
    cache = make_cache(model, max_seqs=2)
    a, b = cache.seq_new(), cache.seq_new()
    ids_a, ids_b = [4, 8, 15, 16, 23, 42], [7, 7, 7]
    logits = run_step(model, cache, [(a, ids_a, text_idx(0, 6)), (b, ids_b, text_idx(0, 3))], 12)
    expected, _ = reference_logits(model, torch.tensor(ids_a), text_idx(0, 6))
    torch.testing.assert_close(logits[:6], expected, atol=0.3, rtol=0.05)
