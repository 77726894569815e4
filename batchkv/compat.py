"""Drop-in replacement for the SenseNova-U1 pipeline's `paged_decode` module, on batchkv.

Why the original exists (vllm-omni, `sensenova_u1/paged_decode.py`): decode is ~80% of a think
request, ~20 ms a token over 42 layers, and mostly Python/ATen dispatch. A CUDA graph removes the
dispatch, but only with static shapes and an attention that reads just the valid prefix -- a
bucket-sized buffer with a mask cost 7.96-11.55 ms a step against 1.03 ms for the exact prefix on
an A800. So K/V live in bucket-sized buffers, the length and the write slot in device tensors,
and one captured step per (bucket, generation) serves every length in the bucket.

What switching gains: the same surface (`PagedDecodeCache`, `DecodeGraphRunner`,
`paged_decode_supported`, `dynamic_lora_wrappers_present`, `BUCKETS`, `TAIL_STEP`; change the
import, nothing else) without the vLLM wheel (the original needs `vllm.vllm_flash_attn` with the
paged keyword arguments, probed at run time), and any head_dim batchkv's Triton `sdpa_varlen`
takes -- a multiple of 16 from 16 to 256 -- on any CUDA GPU Triton targets. The cache is the
`max_seqs = 1` case of batchkv's column store, so the kernel, graph keying and growth rules are
the ones the batched executor uses (see `batchkv.cache.single`).

When to delete: with the pipeline's decode moved onto batchkv's executor (several sequences per
forward, continuous batching), this module has no caller.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchkv import ops
from batchkv.cache.single import BUCKETS, TAIL_STEP, PagedDecodeCache
from batchkv.checks import device_arg, int_arg
from batchkv.errors import ConfigError, ContractError, StepError
from batchkv.executor.graphs import (
    AdapterGuard,
    GraphSet,
    ModuleFingerprint,
    adapter_wrapper_classes,
    dynamic_lora_wrappers_present,
    register_adapter_wrapper,
)
from batchkv.ops.support import refusal

__all__ = [
    "BUCKETS",
    "TAIL_STEP",
    "DecodeGraphRunner",
    "PagedDecodeCache",
    "adapter_wrapper_classes",
    "dynamic_lora_wrappers_present",
    "paged_decode_supported",
    "register_adapter_wrapper",
]


def paged_decode_supported(device: torch.device | str, head_dim: int) -> bool:
    """True when `PagedDecodeCache` can attend on `device` through the capturable Triton kernel.

    Needs CUDA, Triton importable with batchkv's kernel built, and head_dim a multiple of 16
    in [16, 256] (the kernel's tile contract). Elsewhere the pipeline keeps its ordinary cache.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"paged_decode_supported: {device!r} is not a device torch knows") from None
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if refusal(torch.bfloat16, head_dim, "triton"):
        return False
    if not ops.triton_available(device):
        return False
    try:
        ops.backend_functions("triton")
    except (ConfigError, ImportError):
        return False
    return True


# ---- decode graph runner ---------------------------------------------------------------------
class DecodeGraphRunner:
    """One captured decode step per (bucket, generation, module tree), replayed for every token.

    Everything a step reads that varies -- the token, its RoPE index, the write slot and the live
    length -- sits in device tensors, so one capture serves every step in a bucket and every later
    request that fits the same cache: fill the tensors, replay, read the static logits. A capture
    goes stale when the cache reallocates (`generation` moves, once per bucket boundary) or the
    module tree changes; stale graphs are dropped.

    The step calls `language_model(input_ids=[1, 1] int64, indexes=[3, 1] int64 (t, 0, 0),
    past_key_values=None, use_cache=False, paged_cache=cache).logits`.

    Runs eagerly (the same step, no graph) on a machine without CUDA, with an attention backend
    that cannot be captured (the torch reference), and for good once adapter wrappers appear under
    the model (see `dynamic_lora_wrappers_present`; existing graphs are dropped). `graphs` may
    inject a `GraphSet`-like object (tests record keys with it).

    Example:
        runner = DecodeGraphRunner(lm, paged, device)
        paged.set_length(paged.length + 1)
        logits = runner.step(token, t_index)     # [1, 1, vocab], static while graphs are used
    """

    def __init__(
        self, language_model: nn.Module, cache: PagedDecodeCache, device: torch.device | str, *, graphs: Any = None
    ) -> None:
        self.lm = language_model
        self.cache = cache
        self.device = device_arg(device, "DecodeGraphRunner device")
        self.input_ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.indexes = torch.zeros(3, 1, dtype=torch.long, device=self.device)
        self._fingerprint = ModuleFingerprint(language_model)
        capturable = getattr(getattr(cache, "inner", None), "attention", "triton") != "reference"
        if graphs is None and capturable and self.device.type == "cuda" and torch.cuda.is_available():
            # GraphSet draws on the GPU's one shared pool (`graph_pool`): the pipeline rebuilds a
            # runner whenever the cache reallocates or adapters appear, and a private pool per
            # runner grew device memory by ~40 MiB a request in the original.
            graphs = GraphSet(self.device, warmup=3)
        self._graphs = graphs
        self._adapters = AdapterGuard(self._fingerprint, lambda: [language_model])
        self.eager_steps = 0

    @property
    def captures(self) -> int:
        """Graphs captured so far by this runner."""
        return self._graphs.captures if self._graphs is not None else 0

    def adapters_present(self) -> bool:
        """`dynamic_lora_wrappers_present(lm)`, re-walked only when the module tree or registry moved."""
        return self._adapters()

    def uses_graphs(self) -> bool:
        """Whether the next `step` replays (capturing first if needed) rather than runs eagerly."""
        return self._graphs is not None and not self.adapters_present()

    def graph_key(self) -> tuple[int, int, int]:
        """(bucket, generation, module fingerprint): what a capture binds."""
        return (self.cache.bucket, self.cache.generation, self._fingerprint())

    def _forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.lm(
                input_ids=self.input_ids,
                indexes=self.indexes,
                past_key_values=None,
                use_cache=False,
                paged_cache=self.cache,
            ).logits

    def step(self, token: int | torch.Tensor, t_index: int | torch.Tensor) -> torch.Tensor:
        """Run one decode step for `token` at RoPE index (t_index, 0, 0); returns its logits.

        The cache must be staged for the step (`cache.set_length(n)`). Under graphs the returned
        tensor is the capture's static output: read or copy it before the next step.
        """
        if not self.cache.inner.prepared:  # a replay would silently reuse the last staged slot
            raise StepError(
                f"DecodeGraphRunner.step: the cache is not staged for a step (length {self.cache.length}); "
                "call cache.set_length(n) with n >= 1 first"
            )
        for name, value in (("token", token), ("t_index", t_index)):
            if not isinstance(value, torch.Tensor):
                int_arg(f"DecodeGraphRunner.step: {name}", value, 0, error=ContractError)
        self.input_ids[0, 0] = token
        self.indexes[0, 0] = t_index
        if not self.uses_graphs():
            if self._graphs is not None and len(self._graphs):
                self._graphs.retain(lambda key: False)
            self.eager_steps += 1
            return self._forward()
        key = self.graph_key()
        if key not in self._graphs:  # storage moved or the tree changed: older graphs never replay again
            self._graphs.retain(lambda old: old[1:] == key[1:])
        return self._graphs.run(key, self._forward)
