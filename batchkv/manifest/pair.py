"""A DFlash pair manifest: the target's `batched-sequence` manifest and its drafter's, in one file.

    {"version": 1, "kind": "dflash-pair", "block_size": 16, "target": {...}, "drafter": {...}}

The target is causal; the drafter is `causal: false` (its steps are non-causal blocks), with its
own geometry (its layer count; the target's KV heads and head_dim, since a DFlash drafter shares
the target's width), the same sequences and capacity, and a `max_write` that holds a prompt chunk's
context rows plus a block. `from_manifest` on a pair builds both caches (`CachePair`); `batchkv
inspect` shows both. Each part is a full `Manifest`, checked as one; a refusal names its path
under `$.target` or `$.drafter`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec
from msgspec import Struct

from batchkv.errors import ConfigError, ManifestError
from batchkv.manifest.codec import MAX_FILE_BYTES, decode_manifest
from batchkv.manifest.schema import Layer, Manifest

PAIR_KIND = "dflash-pair"


class ManifestPair(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A target manifest and its DFlash drafter's (see the module docstring)."""

    version: int
    kind: Literal["dflash-pair"]
    block_size: int
    target: Manifest
    drafter: Manifest

    def __post_init__(self) -> None:
        t, d = self.target, self.drafter
        if self.version != 1:
            raise ManifestError("$.version", f"this runtime reads pair version 1, not {self.version!r}")
        if type(self.block_size) is not int or not 2 <= self.block_size <= t.max_write:
            raise ManifestError(
                "$.block_size", f"must be in [2, target max_write {t.max_write}]; got {self.block_size}"
            )
        for name, m in (("target", t), ("drafter", d)):
            if m.layout != "batched-sequence":
                raise ManifestError(f"$.{name}.layout", f"a pair holds batched-sequence manifests; got {m.layout!r}")
        if not t.is_causal or d.is_causal:
            raise ManifestError("$.drafter.causal", "the target is causal and the drafter is not (causal: false)")
        for field in ("max_seqs", "maximum_capacity"):
            if getattr(t, field) != getattr(d, field):
                raise ManifestError(f"$.drafter.{field}", f"must equal the target's {getattr(t, field)}")
        if d.max_write < self.block_size:
            raise ManifestError("$.drafter.max_write", f"must hold a block of {self.block_size} rows")


class CachePair(NamedTuple):
    """The two caches a pair manifest builds."""

    target: object
    drafter: object


def make_pair(target: Manifest, *, draft_layers: int, block_size: int = 16) -> ManifestPair:
    """The pair for `target` and a drafter of `draft_layers` flat layers (KV geometry of the target)."""
    max_write = min(target.maximum_capacity, max(target.max_write, block_size) + block_size)
    layers = tuple(Layer(i, "flat", 0) for i in range(draft_layers)) if isinstance(draft_layers, int) else ()
    try:
        drafter = msgspec.structs.replace(
            target,
            model=f"{target.model}-dflash" if isinstance(target.model, str) else msgspec.UNSET,
            num_layers=draft_layers,
            layers=layers,
            max_write=max_write,
            causal=False,
            step_widths=(),
        )
    except ManifestError as exc:  # the drafter's field, not the target's
        raise ManifestError(f"$.drafter{exc.path[1:]}", exc.rule) from None
    return ManifestPair(version=1, kind=PAIR_KIND, block_size=block_size, target=target, drafter=drafter)


def encode_pair_json(pair: ManifestPair) -> bytes:
    """Indented JSON (two spaces), keys in schema order."""
    return (json.dumps(msgspec.to_builtins(pair), indent=2) + "\n").encode()


def dump_pair(pair: ManifestPair, path: str | os.PathLike[str]) -> Path:
    """Write a pair as JSON, replacing the file atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode_pair_json(pair))
    os.replace(tmp, path)
    return path


def is_pair(data: bytes) -> bool:
    """True when JSON bytes hold a pair (a top-level "kind" of "dflash-pair")."""
    try:
        top = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False
    return isinstance(top, dict) and top.get("kind") == PAIR_KIND


def decode_pair(data: bytes) -> ManifestPair:
    """A validated pair from JSON bytes; a part's refusal is named under `$.target` / `$.drafter`."""
    if len(data) > MAX_FILE_BYTES:
        raise ManifestError("$", f"input is more than {MAX_FILE_BYTES} bytes")
    try:
        top = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ManifestError("$", f"not valid JSON: {exc}") from None
    parts = {}
    for name in ("target", "drafter"):
        if not isinstance(top.get(name), dict):
            raise ManifestError(f"$.{name}", "required manifest object is missing")
        try:
            parts[name] = decode_manifest(msgspec.json.encode(top[name]), "json")
        except ManifestError as exc:
            raise ManifestError(f"$.{name}{exc.path[1:]}", exc.rule) from None
    try:
        return ManifestPair(**{**top, **parts})
    except TypeError as exc:
        raise ManifestError("$", f"a pair has version, kind, block_size, target and drafter ({exc})") from None


def read_source(source: str | os.PathLike[str] | bytes) -> bytes:
    """The bytes of a manifest file or of the bytes given."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"a manifest source is a file path or the file's bytes, not {type(source).__name__}")
    with Path(source).open("rb") as f:
        return f.read(MAX_FILE_BYTES + 1)
