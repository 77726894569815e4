"""Models that attend through `cache.update_and_attend`: SenseNova-U1 and a transformers adapter.

The model interface the executor drives (every model here implements it):

    logits = model(input_ids, indexes, cache, logits_rows)
      input_ids:   int64 [W]     packed token ids of the step (padding rows hold any valid id, e.g. 0)
      indexes:     int64 [3, W]  RoPE index per token, rows (t, h, w); text tokens use (t, 0, 0).
                                 The transformers adapter reads only row 0 as position_ids.
      cache:       a BatchedSequenceCache already declared and prepared for this step (width W)
      logits_rows: int64 [R]     rows of W whose logits are wanted (R <= 64); only these go
                                 through the final norm and the LM head
      returns      float32 [R, vocab]

    model.cache_spec() -> dict(num_layers=, kv_heads=, head_dim=, layers=tuple[LayerSpec], dtype=)
        (optionally value_dim=: the values' width when it is not head_dim)
        so that `CacheConfig(**model.cache_spec(), max_seqs=..., capacity=..., max_write=...)`.
    model.vocab_size, model.device, model.dtype

Attention goes through `cache.update_and_attend(layer, q [W, Hq, D], k [W, Hkv, D], v, scale=...)`
only (causal). The forward is CUDA-graph capturable: no `.item()`, no host reads of tensors, no
data-dependent shapes, no Python branching on tensor values; everything is static given W and R.
All device tensors (input_ids, indexes, logits_rows) must live on `model.device`; rows of padding
produce garbage hidden states that never reach a real row (attention gives them zeros and
nothing reads them), so never list them in `logits_rows`.

Example:
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    cache = BatchedSequenceCache(CacheConfig(**model.cache_spec(), max_seqs=4, capacity=256, max_write=8))
    a = cache.seq_new()
    cache.declare_step([a] * 5); cache.prepare_step(width=8)
    ids = torch.tensor([1, 2, 3, 4, 5, 0, 0, 0]); idx = torch.zeros(3, 8, dtype=torch.int64)
    idx[0, :5] = torch.arange(5)
    logits = model(ids, idx, cache, torch.tensor([4]))   # [1, 512] float32: next-token logits
    cache.commit_step()

`batchkv.models.hf.HFModel` (imported on demand; needs transformers) wraps a transformers causal LM
behind the same interface.
"""

from batchkv.models.config import MODEL_PRESETS, SenseNovaConfig, preset_config
from batchkv.models.sensenova import SenseNovaLM
from batchkv.models.weights import (
    build_model,
    checkpoint_shapes,
    load_checkpoint,
    random_init,
    save_checkpoint,
)

__all__ = [
    "MODEL_PRESETS",
    "SenseNovaConfig",
    "SenseNovaLM",
    "build_model",
    "checkpoint_shapes",
    "load_checkpoint",
    "preset_config",
    "random_init",
    "save_checkpoint",
]
