"""A manifest as a table a person reads: what `batchkv inspect` prints."""

from __future__ import annotations

import itertools

from batchkv.manifest.schema import DTYPE_BYTES, SCALE_BYTES, Manifest


def human_bytes(n: int) -> str:
    """1024-based: `172032` -> "168.0 KiB"."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe_ids(ids: list[int]) -> str:
    """Sorted layer ids, compact: "0-41", "1-31 (odd)", "2-29 (step 3)", or ranges "0-3, 8, 10-11"."""
    if len(ids) == 1:
        return str(ids[0])
    step = ids[1] - ids[0]
    if all(b - a == step for a, b in itertools.pairwise(ids)):
        span = f"{ids[0]}-{ids[-1]}"
        if step == 1:
            return span
        if step == 2:
            return f"{span} ({'even' if ids[0] % 2 == 0 else 'odd'})"
        return f"{span} (step {step})"
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def layer_groups(m: Manifest) -> list[tuple[list[int], str, int, int]]:
    """(layer ids, policy, window, rows at full capacity), one entry per distinct storage kind."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for entry in sorted(m.layers, key=lambda e: e.layer_id):
        key = (entry.policy, entry.window, m.rows(entry.layer_id))
        groups.setdefault(key, []).append(entry.layer_id)
    return [(ids, policy, window, rows) for (policy, window, rows), ids in groups.items()]


def _storage(m: Manifest) -> str:
    kv = m.storage_dtype
    if kv not in SCALE_BYTES:
        return kv if kv == m.dtype else f"{kv} (cast from {m.dtype} on write)"
    full = 2 * m.num_layers * m.kv_heads * m.head_dim * DTYPE_BYTES[m.dtype]
    return (
        f"{kv} + an fp32 scale per (position, kv head), quantised on write: {m.bytes_per_token / full:.3f}x "
        f"the bytes of {m.dtype}"
    )


def describe(m: Manifest) -> str:
    """Multi-line summary: layout, sequences, geometry, per-layer storage, bytes and full-capacity memory."""
    per_layer_row = m.bytes_per_token // m.num_layers  # one position of one layer
    if m.layout == "cell":
        seqs = f"shared pool of {m.max_cells} cells (one position of any sequence each)"
    else:
        scratch = f" (+{m.scratch_rows} scratch rows)" if m.scratch_rows else " (no padding, no scratch rows)"
        causal = "causal" if m.is_causal else "non-causal"
        extra = "" if m.layout == "sequence" else f"; max_segments {m.segments}; {causal}"
        seqs = f"{m.sequences}{scratch}{extra}"
    widths = " ".join(map(str, m.step_widths)) or "(none: the executor picks)"
    rows = [
        ("model", m.model if isinstance(m.model, str) else "(not named)"),
        ("layout", f"{m.layout} (manifest version {m.version})"),
        ("sequences", seqs),
        ("capacity", f"{m.maximum_capacity} positions per sequence; max_write {m.max_write}"),
        ("kv geometry", f"{m.num_layers} layers x {m.kv_heads} kv heads x head_dim {m.head_dim}, {m.dtype}"),
        ("kv storage", _storage(m)),
        ("step widths", f"{widths}; max_sample_rows {m.max_sample_rows}"),
    ]
    lines = [f"{label:<16} {value}" for label, value in rows]
    table = [("layers", "policy", "window", "rows", "memory")]
    for ids, policy, window, layer_rows in layer_groups(m):
        pool = layer_rows if m.layout == "cell" else m.sequences * layer_rows + m.scratch_rows
        memory = human_bytes(len(ids) * pool * per_layer_row)
        table.append((describe_ids(ids), policy, str(window or "-"), str(layer_rows), memory))
    width = [max(len(row[i]) for row in table) for i in range(4)]
    lines.append("")
    lines += ["  ".join(row[i].ljust(width[i]) for i in range(4)) + "  " + row[4] for row in table]
    lines += [
        "",
        f"{'bytes per token':<16} {human_bytes(m.bytes_per_token)} ({m.bytes_per_token} B: K+V of every layer"
        + (", scales included)" if m.storage_dtype in SCALE_BYTES else ")"),
        f"{'full capacity':<16} {human_bytes(m.kv_bytes)} ({m.kv_bytes} B of K/V, every sequence at capacity in "
        "every layer; the store holds what the sequences can reach, up to this)",
    ]
    return "\n".join(lines)
