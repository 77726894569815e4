"""The sharding a model needs for tensor parallelism: a leaf under `batchkv.models`.

- `shard`: one rank's share of a model (its query and KV heads, MLP columns, vocabulary rows) and
  the collectives that join the shares (`Shard`; `Shard()` is the whole model in one process);
- `layers`: row-parallel linear layers and the vocab-parallel embedding and LM head;
- `slices`: a safetensors checkpoint read by slice, so no rank reads or holds the whole model;
- `hf`: which slice of each transformers Llama / Qwen3 projection a rank holds, and its modules
  swapped for the sharded ones.

Nothing here imports the rest of the package above the floor; the models import it, and
`batchkv.models.loading` builds a rank's share of a source. Starting the ranks is `batchkv.tp`'s.
"""

from batchkv.models.parallel.shard import Shard

__all__ = ["Shard"]
