"""transformers baselines for bench/decode.py: a Qwen3ForCausalLM of the SenseNova-U1-8B shape.

Timed the way a user would run them: eager forward with `DynamicCache`, `StaticCache` with the
forward compiled in "reduce-overhead" mode (CUDA graphs inside torch.compile), and, as the serving
fallback when continuous batching cannot run (bench/lib/hf_cb.py is the serving peer), `generate` over
left-padded batches with a StaticCache, compiled. Works with transformers 5.17 (`past_key_values=`)
and newer (`cache=`).
"""

from __future__ import annotations

import inspect
import time

import torch


def qwen3_like(device: torch.device, dtype: torch.dtype = torch.bfloat16, tiny: bool = False, seed: int = 0):
    """A randomly initialised Qwen3ForCausalLM with SenseNova-U1-8B's language-model shape (or, tiny,
    the shape of the `sensenova-u1-tiny` preset, for smoke runs on CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32) if tiny else dict(
                 vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=42,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # fmt: skip
    config = Qwen3Config(
        **shape,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        attention_bias=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


@torch.inference_mode()
def decode_ms_per_token(model, prompt_len: int, new_tokens: int, static_compile: bool = False) -> float:
    """Greedy decode of one sequence after a prompt; milliseconds per generated token (decode only).

    static_compile: a `StaticCache` and `torch.compile(mode="reduce-overhead", fullgraph=True)` on the
    forward, warmed up over a full run first so compilation and graph recording are not timed.
    """
    from transformers import DynamicCache, StaticCache

    device = next(model.parameters()).device
    name = _cache_kwarg(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen).to(device)
    static = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens + 8) if static_compile else None
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if static_compile else model.forward

    def run(steps: int) -> float:
        if static is not None:
            static.reset()
        cache = static if static is not None else DynamicCache()
        pos = torch.arange(prompt_len, device=device)
        out = model(input_ids=ids, position_ids=pos[None], cache_position=pos, use_cache=True, **{name: cache})
        token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        start = time.perf_counter()
        for step in range(steps):
            p = torch.full((1,), prompt_len + step, device=device)
            out = forward(input_ids=token, position_ids=p[None], cache_position=p, use_cache=True, **{name: cache})
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        return (time.perf_counter() - start) * 1e3 / steps

    run(16)  # warm-up: cuBLAS handles, and for the compiled path compilation and graph recording
    return run(new_tokens)


@torch.inference_mode()
def static_compiled_batches(model, prompts: list[list[int]], outputs: list[int], batch: int = 64, box_s: float = 120.0):
    """The serving fallback: `generate` over left-padded batches of `batch` with one `StaticCache` (so
    transformers compiles its decode step, "reduce-overhead": CUDA graphs inside torch.compile).

    Every batch is padded to the longest prompt of the whole list and the cache sized for it, so all
    batches share one compiled shape; a warm-up generate of 4 tokens compiles first (untimed). Each
    batch generates to its longest requested output; a request's useful tokens are its own. Batches
    stop once `box_s` is spent. Returns useful tokens/s, the requests done and whether it was cut.
    """
    from transformers import StaticCache

    device = next(model.parameters()).device
    width, longest = max(map(len, prompts)), max(outputs)
    cache = StaticCache(config=model.config, max_cache_len=width + longest)
    name = _cache_kwarg(model)

    def run(chunk: list[list[int]], new: int) -> None:
        ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, p in enumerate(chunk):  # rows past the chunk stay padding (one static batch size)
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        mask[len(chunk) :, -1] = 1
        cache.reset()
        greedy = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
        ids, mask = ids.to(device), mask.to(device)
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **greedy, **{name: cache}
        )

    run(prompts[:batch], 4)  # compile and capture
    useful, requests, elapsed, cut = 0, 0, 0.0, False
    for start in range(0, len(prompts), batch):
        if elapsed > box_s:
            cut = True
            break
        chunk, wants = prompts[start : start + batch], outputs[start : start + batch]
        _sync(device)
        t0 = time.perf_counter()
        run(chunk, max(wants))
        _sync(device)
        elapsed += time.perf_counter() - t0
        useful, requests = useful + sum(wants), requests + len(chunk)
    return {"tokens_per_s": useful / elapsed, "requests": requests, "seconds": elapsed, "boxed": cut}
