"""Tensor parallelism over torch.distributed: one engine across the GPUs of a host.

`Engine(source, tensor_parallel=N)` (and `batchkv run --tensor-parallel N`, `batchkv serve
--tensor-parallel-size N`) runs N processes, NCCL between GPUs or gloo on the CPU:
- `shard`: one rank's share of a model (heads, MLP columns, vocabulary rows) and the collectives
  that join the shares; `layers`, `hf`: the same for transformers models; `slices`: reading a
  checkpoint by slice; `models`: what the engine is given instead of a model, and loading it;
- `group`: the processes, rendezvous, timeouts, failure reports; `channel`: rank 0's plans;
  `roles`: the fixed points the engine calls (one process: `Local`, plain calls);
- `engine`: starting the ranks and running the followers.

    >>> engine = Engine("sensenova-u1-tiny", tensor_parallel=2, max_seqs=4, capacity=256)

The design, what crosses between ranks and why, is in docs/design.md ("Tensor parallelism").
"""

from batchkv.tp.shard import Shard

__all__ = ["Shard"]
