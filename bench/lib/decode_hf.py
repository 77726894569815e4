"""The transformers peer of bench/decode.py's one-sequence part: a Qwen3ForCausalLM of the same
shape (random bf16 weights), greedy, one sequence after a 512-token prompt, timed the way a user
would run it: eager with a `DynamicCache` (`b1_hf_eager`) and with a `StaticCache` and the forward
compiled in "reduce-overhead" mode, CUDA graphs inside torch.compile (`b1_hf_static_compile`).
Works with transformers 5.17 (`past_key_values=`) and newer (`cache=`). Its serving peer,
transformers' continuous batching, is in history (bench/results/README.md)."""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import torch

from .serving import sync


def qwen3_like(device: torch.device, dtype: torch.dtype = torch.bfloat16, tiny: bool = False, seed: int = 0):
    """A randomly initialised Qwen3ForCausalLM with SenseNova-U1-8B's language-model shape (or, tiny,
    the shape of the `sensenova-u1-tiny` preset, for smoke runs on CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32) if tiny else dict(
                 vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=42,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # fmt: skip
    config = Qwen3Config(**shape, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768,
                         attention_bias=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval()


@torch.inference_mode()
def decode_ms_per_token(model, prompt_len: int, new_tokens: int, static_compile: bool = False) -> float:
    """Greedy decode of one sequence after a prompt; milliseconds per generated token (decode only).

    static_compile: a `StaticCache` and `torch.compile(mode="reduce-overhead", fullgraph=True)` on the
    forward, warmed up over a full run first so compilation and graph recording are not timed.
    """
    from transformers import DynamicCache, StaticCache

    device = next(model.parameters()).device
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
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
        sync(device)
        start = time.perf_counter()
        for step in range(steps):
            p = torch.full((1,), prompt_len + step, device=device)
            out = forward(input_ids=token, position_ids=p[None], cache_position=p, use_cache=True, **{name: cache})
            token = out.logits[:, -1:].argmax(-1)
        sync(device)
        return (time.perf_counter() - start) * 1e3 / steps

    run(16)  # warm-up: cuBLAS handles, and for the compiled path compilation and graph recording
    return run(new_tokens)


def hf_parts(parts, ctx: SimpleNamespace) -> None:
    """`b1_hf_eager` and (on CUDA) `b1_hf_static_compile` into the result's `b1`."""
    r, dev = parts.result, ctx.device
    model = qwen3_like(dev, tiny=ctx.small)

    def single(static: bool):
        key = "hf_static_compile_ms" if static else "hf_eager_ms"
        b1 = r.setdefault("b1", {"prompt": ctx.prompt_len, "new_tokens": ctx.new_tokens})
        b1[key] = decode_ms_per_token(model, ctx.prompt_len, ctx.new_tokens, static_compile=static)
        print(f"b1 {key}: {b1[key]:.3f} ms/token", flush=True)

    parts.run("b1_hf_eager", lambda: single(False), need_s=40)
    if dev.type == "cuda":  # on CPU inductor's C++ compile of the model takes minutes: not a smoke test
        parts.run("b1_hf_static_compile", lambda: single(True), need_s=150)
