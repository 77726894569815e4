"""Hidden-state taps: a model's residual stream after chosen layers, for chosen rows of a step.

A DFlash drafter's context features are the target's hidden states after `layer_ids`,
concatenated per position. `HiddenTaps` owns one static buffer for them and the row selector; a
model's `hidden_states(..., taps=...)` calls `record(layer, h)` after each layer, and only tapped
layers copy anything: `index_select` of the tapped rows into their slice of `out`. Nothing is
materialised for untapped layers or rows. Capturable (fixed addresses, no host reads).
"""

from __future__ import annotations

import torch

from batchkv.errors import ConfigError


class HiddenTaps:
    """out: [rows, len(layer_ids) * hidden] in `dtype`, layer j's states in columns [j*H, (j+1)*H);
    rows: int64 [rows], the packed rows of the step to tap (default 0, 1, 2, ...).

    >>> taps = HiddenTaps((1, 3), hidden=128, max_rows=64, device="cpu", dtype=torch.float32)
    >>> h = model.hidden_states(ids, idx, cache, logits_rows, taps=taps.bind(width))
    >>> taps.out[:width]   # [width, 256]: after layers 1 and 3, for packed rows 0..width-1
    """

    def __init__(
        self,
        layer_ids: tuple[int, ...],
        hidden: int,
        max_rows: int,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        _views: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if not layer_ids or len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < 0:
            raise ConfigError(f"tapped layer ids {layer_ids} must be distinct and non-negative (at least one)")
        self.layer_ids, self.hidden = tuple(layer_ids), hidden
        self._slot = {layer: j for j, layer in enumerate(self.layer_ids)}
        if _views is None:
            self.rows = torch.arange(max_rows, dtype=torch.int64, device=device)
            self.out = torch.zeros(max_rows, len(layer_ids) * hidden, dtype=dtype, device=device)
        else:
            self.rows, self.out = _views

    def bind(self, rows: int) -> HiddenTaps:
        """The taps of a step that taps its first `rows` selector entries (views: same storage)."""
        return HiddenTaps(self.layer_ids, self.hidden, rows, self.out.device, self.out.dtype,
                          _views=(self.rows[:rows], self.out[:rows]))  # fmt: skip

    def record(self, layer: int, h: torch.Tensor) -> None:
        """After `layer`: copy the selected rows of h [W, H] into that layer's slice, if tapped."""
        j = self._slot.get(layer)
        if j is not None:
            self.out[:, j * self.hidden : (j + 1) * self.hidden].copy_(h.index_select(0, self.rows))
