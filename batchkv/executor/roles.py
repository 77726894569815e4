"""The engine's fixed points for tensor parallelism: the protocol its role implements, and `Local`.

The engine and its runners call their role at the same few points whatever the world size; the
one-process role, `Local`, makes each a plain call, so a single-GPU step has no branch for it:
- `cache(config, device, attention=)`: the engine's cache (and a DFlash drafter's);
- `bind(obj, staging)`: an object (a runner, the drafter's proposer) whose device steps run on
  every rank, with the pinned staging buffers its steps read;
- `run(step, *args)`: one device step, `step` a bound method of a bound object (forward,
  sampling); `read(tokens)`: that step's tokens on the host;
- `share(tensor)`: inside a step, every rank's `tensor` becomes rank 0's (tokens that only rank 0
  could sample: penalties and constraints are host state of rank 0's scheduler);
- `agree(positions)`, `ready()`: construction (store sizing; every rank built); `close()`.

The multi-rank roles (`Leader` on rank 0, `Follower` elsewhere) are `batchkv.tp.roles`'; the
executor knows them only through this protocol.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.cache.staging import Staging


class Role(Protocol):
    """What the engine and its runners hold (`Engine.role`): this process's part in the step."""

    rank: int
    world: int
    capture_error_mode: str  # how a CUDA graph capture treats other threads' CUDA calls

    def cache(self, config: CacheConfig, device: torch.device, *, attention: str) -> BatchedSequenceCache: ...

    def bind(self, obj: object, staging: Staging) -> None: ...

    def run(self, step: Any, *args: Any) -> Any: ...

    def read(self, tokens: Any) -> Any: ...

    def share(self, tensor: torch.Tensor) -> None: ...

    def agree(self, positions: int) -> int: ...

    def ready(self) -> None: ...

    def close(self) -> None: ...


class Local:
    """One process: every fixed point is a plain call."""

    rank, world = 0, 1
    capture_error_mode = "global"  # torch.cuda.graph's default

    def cache(self, config: CacheConfig, device: torch.device, *, attention: str) -> BatchedSequenceCache:
        """A plain `BatchedSequenceCache`."""
        return BatchedSequenceCache(config, device, attention=attention)

    def bind(self, obj: object, staging: Staging) -> None:
        """Nothing to bind: no other rank replays the steps."""
        return None

    def run(self, step: Any, *args: Any) -> Any:
        """`step(*args)`."""
        return step(*args)

    def read(self, tokens: Any) -> Any:
        """`tokens.read()`."""
        return tokens.read()

    def share(self, tensor: torch.Tensor) -> None:
        """Nothing to share: this process is rank 0."""
        return None

    def agree(self, positions: int) -> int:
        """`positions`: no other rank to agree with."""
        return positions

    def ready(self) -> None:
        """Nothing to wait for."""
        return None

    def close(self) -> None:
        """Nothing to stop."""
        return None


LOCAL = Local()
