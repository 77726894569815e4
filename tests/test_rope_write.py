"""RoPE in the K/V write (`sdpa_varlen(rope=)`, `kv_write`'s ROPE, `hf_rope.deferred_rope`), against
transformers' `apply_rotary_pos_emb` and the unfused path: the same stores, queries and outputs."""

from __future__ import annotations

import pytest
import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.errors import ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.kv_write_triton import launch_kv_write
from batchkv.ops.rope import rope_rows

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from transformers.models.llama import modeling_llama  # noqa: E402

from batchkv.models import hf_rope  # noqa: E402
from batchkv.models.hf import HFModel  # noqa: E402
from batchkv.ops.sdpa.launch import sdpa_varlen  # noqa: E402
from tests.model_loop import greedy_through_cache  # noqa: E402
from tests.test_models_hf_norms import GEOMETRY, MAX_NEW, PROMPTS, _hf_greedy, _peaky  # noqa: E402

E4M3 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits in the interpreter; on the GPU the compiler may contract an fp32 product and sum into one
    FMA (the casts between them are no-ops in fp32; 16-bit ones are real and keep torch's roundings)."""
    exact = DEVICE == "cpu"
    tol = 0.0 if exact else 2**-20
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.nan_to_num().abs().max().item(), equal_nan=True)


def _cos_sin(width: int, d: int, dtype: torch.dtype, positions=(0, 3, 17, 100, 1000, 7, 2)):
    config = transformers.LlamaConfig(head_dim=d, hidden_size=4 * d, num_attention_heads=4)
    x = torch.zeros(1, dtype=dtype)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(x, torch.tensor([list(positions)[:width]]))
    return cos[0].to(DEVICE), sin[0].to(DEVICE)  # [W, D]


def _qkv(width: int, q_heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as strided views of one fused projection [W, (Hq + 2 Hkv) * D], as a model hands them on."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(width, (q_heads + 2 * kv_heads) * d, generator=gen) * 3).to(dtype).to(DEVICE)
    q = qkv[:, : q_heads * d].view(width, q_heads, d)
    k = qkv[:, q_heads * d : (q_heads + kv_heads) * d].view(width, kv_heads, d)
    return q, k, qkv[:, (q_heads + kv_heads) * d :].view(width, kv_heads, d)


def _flat_stores(dtype: torch.dtype, slots: int, kv_heads: int, d: int):
    """K, V [slots, Hkv, D] poisoned with NaN (e4m3: its NaN code) and, for e4m3, their scale planes [slots, 1, Hkv]."""
    k = torch.full((slots, kv_heads, d), float("nan")).to(dtype).to(DEVICE)
    scales = tuple(torch.full((slots, 1, kv_heads), float("nan"), device=DEVICE) for _ in range(2))
    return k, k.clone(), *(scales if dtype == E4M3 else (None, None))


@pytest.mark.parametrize("store", [torch.float32, torch.bfloat16, E4M3])
@pytest.mark.parametrize(("q_heads", "kv_heads", "d"), [(4, 2, 16), (9, 3, 64), (6, 2, 48)])  # 48: masked columns
def test_the_write_rotates_q_and_k_as_transformers_and_stores_what_the_unfused_write_stores(
    store, q_heads, kv_heads, d
):
    dtype = torch.float32 if store == torch.float32 else torch.bfloat16
    width = 5
    q, k, v = _qkv(width, q_heads, kv_heads, d, dtype)
    cos, sin = _cos_sin(width, d, dtype)
    slots = torch.tensor([9, 2, 14, 0, 6], device=DEVICE)
    fused, plain = _flat_stores(store, 16, kv_heads, d), _flat_stores(store, 16, kv_heads, d)
    q_out = launch_kv_write(*fused[:2], k, v, slots, *fused[2:], rope=(q, cos, sin))
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2),
                                                         cos[None], sin[None])  # fmt: skip
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)
    assert q_out.shape == q.shape and q_out.dtype == q.dtype and q_out.is_contiguous()
    if dtype == torch.float32:  # torch's products and sum
        _same(q_out, want_q)
        assert torch.equal(rope_rows(k, cos, sin), want_k)
    else:  # the interpreter's bf16 casts round otherwise than torch's: a bf16 ulp
        torch.testing.assert_close(q_out, want_q, rtol=2**-7, atol=2**-7 * want_q.abs().max().item())
    launch_kv_write(*plain[:2], rope_rows(k, cos, sin), v, slots, *plain[2:])  # the rotated k, unfused
    for got, ref in zip(fused, plain, strict=True):
        if got is None:
            continue
        got, ref = got.float(), ref.float()
        if dtype == torch.float32:
            _same(got, ref)
        else:
            torch.testing.assert_close(got, ref, rtol=2**-3, atol=2**-7 * ref.nan_to_num().abs().max().item(),
                                       equal_nan=True)  # fmt: skip
        untouched = [s for s in range(16) if s not in slots.tolist()]
        assert got[untouched].isnan().all()  # nothing else was written


@pytest.mark.parametrize("store", [torch.float32, E4M3])
def test_attention_with_rope_in_the_write_gives_attention_over_rotated_rows(store):
    q_heads, kv_heads, d, columns, rows = 4, 2, 16, 3, 12
    q, k, v = _qkv(5, q_heads, kv_heads, d, torch.float32, seed=4)
    cos, sin = _cos_sin(5, d, torch.float32)
    info = torch.tensor([[0, 2, 1, 9], [2, 3, 0, 3]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([7 * columns + 1, 8 * columns + 1, 0, columns, 2 * columns], device=DEVICE)
    outs = {}
    for name in ("rope", "rotated", "reference"):
        k_store = torch.randn(rows, columns, kv_heads, d, generator=torch.Generator().manual_seed(2)).to(store)
        k_store = k_store.to(DEVICE)
        v_store = k_store.clone()
        scales = {name: torch.ones(rows, columns, kv_heads, device=DEVICE) for name in ("k_scale", "v_scale")}
        scales = scales if store == E4M3 else {}
        if name == "rope":
            out = sdpa_varlen(q, k_store, v_store, info, write=(k, v, slots), rope=(cos, sin), **scales)
        elif name == "rotated":
            write = (rope_rows(k, cos, sin), v, slots)
            out = sdpa_varlen(rope_rows(q, cos, sin), k_store, v_store, info, write=write, **scales)
        else:
            out = sdpa_varlen_reference(q, k_store, v_store, info, write=(k, v, slots), rope=(cos, sin), **scales)
        outs[name] = (out, k_store.float(), v_store.float())
    for a, b in zip(outs["rope"], outs["rotated"], strict=True):
        _same(a, b)
    for a, b in zip(outs["rope"], outs["reference"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


BAD = {
    "no write": lambda a: a.update(write=None),
    "cos of the wrong width": lambda a: a.update(rope=(a["rope"][0][:3], a["rope"][1][:3])),
    "cos of another dtype": lambda a: a.update(rope=(a["rope"][0].double(), a["rope"][1].double())),
    "cos and sin of different strides": lambda a: a.update(rope=(a["rope"][0], a["rope"][1].t().contiguous().t())),
    "an odd head width": lambda a: a.update(rope=(a["rope"][0][:, :15], a["rope"][1][:, :15])),
}


@pytest.mark.parametrize("attend", [sdpa_varlen, sdpa_varlen_reference], ids=["triton", "reference"])
@pytest.mark.parametrize("breach", list(BAD))
def test_a_bad_rope_is_refused_before_anything_is_written(attend, breach):
    q, k, v = _qkv(5, 4, 2, 16, torch.float32)
    k_store = torch.zeros(12, 3, 2, 16, device=DEVICE)
    args = {"write": (k, v, torch.arange(5, device=DEVICE)), "rope": _cos_sin(5, 16, torch.float32)}
    BAD[breach](args)
    info = torch.tensor([[0, 5, 0, 5]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ContractError, match="rope"):
        attend(q, k_store, k_store.clone(), info, **args)
    assert not k_store.any()


@pytest.mark.parametrize("rotation", [False, True])
def test_the_cache_takes_unrotated_q_and_k_with_rope_whether_or_not_its_keys_rotate(rotation):
    kw = dict(num_layers=1, kv_heads=2, head_dim=16, max_seqs=2, capacity=32, max_write=8)
    if rotation:
        kw.update(kv_dtype=E4M3, key_rotation=True)
    q, k, v = _qkv(6, 4, 2, 16, torch.float32, seed=7)
    cos, sin = _cos_sin(6, 16, torch.float32, positions=(0, 1, 2, 0, 1, 2))
    outs = []
    for rope in (True, False):
        cache = BatchedSequenceCache(CacheConfig(**kw), DEVICE, attention="triton")
        assert cache.fuses_rope is not rotation
        a, b = cache.seq_new(), cache.seq_new()
        cache.begin_step([a, a, a, b, b, b], 6)
        if rope:
            outs.append(cache.update_and_attend(0, q, k, v, rope=(cos, sin)))
        else:
            outs.append(cache.update_and_attend(0, rope_rows(q, cos, sin), rope_rows(k, cos, sin), v))
    _same(outs[0], outs[1])


def _llama():
    return _peaky(transformers.LlamaForCausalLM(transformers.LlamaConfig(**GEOMETRY)), seed=3)


def test_under_batchkvs_attention_the_write_rotates_and_greedy_tokens_equal_transformers(monkeypatch):
    hf = _llama()
    want = [_hf_greedy(hf, prompt, n) for prompt, n in zip(PROMPTS, MAX_NEW, strict=True)]
    model = HFModel(hf.to(DEVICE))  # on a GPU its kernels; here the interpreter
    calls = []
    real = hf_rope.rope_qk
    monkeypatch.setattr(hf_rope, "rope_qk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert greedy_through_cache(model, PROMPTS, MAX_NEW, max_write=4, bucket=4, attention="triton") == want
    assert calls == []  # every layer's RoPE went into the write
    monkeypatch.setattr(hf_rope, "WRITE_ROPE", False)
    assert greedy_through_cache(model, PROMPTS, MAX_NEW, max_write=4, bucket=4, attention="triton") == want
    assert calls  # the A/B switch: the RoPE kernel before the write, as before


def test_a_cache_that_does_not_fuse_rope_gets_rotated_q_and_k():
    class Plain:  # a cache with no `fuses_rope` (the single-sequence facade, a scoring cache of its own)
        pass

    q, k, _ = _qkv(5, 4, 2, 16, torch.float32)
    cos, sin = _cos_sin(5, 16, torch.float32)
    query, key = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, H, W, D] as the module hands them on
    got_q, got_k, extras = hf_rope.deferred_rope(Plain(), query, key, {hf_rope.ROPE_KWARG: (cos[None], sin[None])})
    assert extras == {}
    _same(got_q[0].transpose(0, 1), rope_rows(q, cos, sin))
    _same(got_k[0].transpose(0, 1), rope_rows(k, cos, sin))
    cache = BatchedSequenceCache(CacheConfig(num_layers=1, kv_heads=2, head_dim=16, max_seqs=1, capacity=8), "cpu")
    same_q, same_k, extras = hf_rope.deferred_rope(cache, query, key, {hf_rope.ROPE_KWARG: (cos[None], sin[None])})
    assert same_q is query and same_k is key and torch.equal(extras["rope"][0], cos)
    assert hf_rope.deferred_rope(cache, query, key, {}) == (query, key, {})


def test_a_cache_subclass_that_overrides_update_and_attend_is_handed_rotated_q_and_k():
    class Reading(BatchedSequenceCache):  # reads q, as `batchkv.score`'s query moments do
        def update_and_attend(self, layer, q, k, v, **extras):
            return super().update_and_attend(layer, q, k, v, **extras)

    config = CacheConfig(num_layers=1, kv_heads=2, head_dim=16, max_seqs=1, capacity=8)
    assert BatchedSequenceCache(config, "cpu").fuses_rope and not Reading(config, "cpu").fuses_rope
