"""Tensor parallelism over torch.distributed: one engine across the GPUs of a host.

`Engine(source, tensor_parallel=N)` (or `launch(source, N, **options)`, and `batchkv run
--tensor-parallel N`, `batchkv serve --tensor-parallel-size N`) runs N processes, NCCL between GPUs
or gloo on the CPU. This package is the rank orchestration, above the executor:
- `launch`: starting the ranks (`start`, which the engine calls through
  `batchkv.executor.launch`) and running the followers;
- `group`: the processes, rendezvous, timeouts, failure reports; `channel`: rank 0's plans;
- `roles`: `Leader` and `Follower`, the multi-rank answers to the engine's fixed points
  (`batchkv.executor.roles.Role`; one process: `LOCAL`, plain calls).
What a model needs to run sharded (`Shard`, sharded layers, reading checkpoints by slice) is
`batchkv.models.parallel`; loading a rank's share of a source is `batchkv.models.loading`.

    >>> engine = Engine("sensenova-u1-tiny", tensor_parallel=2, max_seqs=4, capacity=256)

The design, what crosses between ranks and why, is in docs/design.md ("Tensor parallelism").
"""

from batchkv.tp.launch import launch

__all__ = ["launch"]
