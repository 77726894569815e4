"""The package-internal hooks of the single-sequence facade (`batchkv.cache.single`): set a
sequence's length forward over K/V already written, load a history from outside, read one back.
Nothing else in the package calls them; the batched engine uses the public verbs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchkv.errors import CapacityError, ContractError


class FacadeHooks:
    """Hooks of `BatchedSequenceCache` (a base class of it: no state of its own) for `PagedDecodeCache`."""

    def _set_length(self, seq: int, new_len: int) -> None:
        """Move `seq`'s length to `new_len`, back (as `rewind`, same refusals) or forward.

        Forward asserts that positions [pos, new_len) already hold K/V the caller wrote (the facade
        re-stages a one-token step whose K/V an earlier attend wrote); nothing is copied. Refused
        past the allocated rows (grow with `reserve` first). A declared step naming `seq` must be
        prepared again. Host side; package-internal: everything else uses the public verbs.
        """
        length = self._known(seq)
        if new_len <= length:
            self.rewind(seq, new_len)
            return
        if new_len > self._height[seq]:
            raise CapacityError(
                f"_set_length: sequence {seq} cannot reach {new_len} positions in {self._height[seq]} rows; "
                "reserve() first"
            )
        self._len[seq] = new_len
        self._hw[seq] = max(int(self._hw[seq]), new_len)
        self._restage(seq)

    def _load_prefix(self, seq: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Replace `seq`'s history with external K/V: one [n, Hkv, D] tensor per layer for each.

        Grows storage first and checks every tensor before copying, so a refusal changes nothing.
        The length becomes n. Host side; package-internal (the facade's `load_prefix`).
        """
        self._known(seq)
        cfg = self.config
        n = keys[0].shape[0] if len(keys) else 0
        want = (n, cfg.kv_heads, cfg.head_dim)
        if len(keys) != cfg.num_layers or len(values) != cfg.num_layers:
            raise ContractError(f"_load_prefix: got {len(keys)}/{len(values)} layers of K/V for {cfg.num_layers}")
        bad = [tuple(t.shape) for t in (*keys, *values) if tuple(t.shape) != want]
        if bad:
            raise ContractError(f"_load_prefix: every K/V must be {list(want)} (n, Hkv, D); got {bad[0]}")
        if not 0 < n <= cfg.capacity:
            raise CapacityError(f"_load_prefix: {n} positions is outside [1, capacity={cfg.capacity}]")
        self._resize({int(seq): cfg.rows_for(n)})
        if self._rotation is not None:  # the store holds rotated keys
            keys = [self._rotation.rotate_keys(k) for k in keys]
        if self._rounding is not None:  # rounded as the step's write rounds them
            keys = [self._rounding.round(layer, k) for layer, k in enumerate(keys)]
        for layer in range(cfg.num_layers):
            self._store.write_column(seq, layer, keys[layer], values[layer])
        self._len[seq] = n
        self._hw[seq] = n  # every resident row now holds the new history
        self._restage(seq)

    def _read_prefix(self, seq: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of positions [0, n) of `seq` (flat layers, n <= its reach: a staged step's positions
        count), one [n, Hkv, D] tensor per layer each, in `config.dtype` (e4m3 dequantised).
        Host side; package-internal (the facade's `to_dynamic_cache`)."""
        self._known(seq)
        pairs = [self._store.read_column(seq, layer, n) for layer in range(self.config.num_layers)]
        keys = [k if self._rotation is None else self._rotation.unrotate(k) for k, _ in pairs]
        return keys, [v for _, v in pairs]
