"""Reading and writing manifests: indented JSON and msgpack, both exact round trips.

`load_manifest(path_or_bytes)` picks the format from the extension (.json, .msgpack, .mpk) or,
failing that, from the first byte (`{` is JSON, a msgpack map header is msgpack). Whatever is
wrong with the input, the caller gets a `ManifestError` naming the JSON path and the rule; only
the operating system's own errors (a missing file) pass through as `OSError`. A key given twice
in one object is refused in either format (msgspec would keep the last; another reader, the first).

The JSON writer puts one key per line in schema order and one layer per line, so files diff well;
`encode_json(decode(data)) == data` for every file it wrote.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import msgspec

from batchkv.errors import ConfigError, ManifestError
from batchkv.manifest.schema import DTYPE_BYTES, KV_DTYPE_BYTES, LAYOUTS, POLICIES, Layer, Manifest, key_path

MAX_FILE_BYTES = 4 << 20  # a 1024-layer manifest is ~60 KiB
SUFFIXES = {".json": "json", ".msgpack": "msgpack", ".mpk": "msgpack"}
_ENUM_HINTS = {"layout": LAYOUTS, "policy": POLICIES, "dtype": tuple(DTYPE_BYTES), "kv_dtype": tuple(KV_DTYPE_BYTES)}
_AT = re.compile(r"(?P<msg>.*?)(?: - at `(?P<path>\$[^`]*)`)?", re.S)


def encode_json(m: Manifest) -> bytes:
    """UTF-8 JSON, keys in schema order, two-space indent, one layer per line, trailing newline."""
    lines = []
    for key, value in msgspec.to_builtins(m).items():
        if key == "layers" and value:
            text = "[\n" + ",\n".join(f"    {json.dumps(entry)}" for entry in value) + "\n  ]"
        else:
            text = json.dumps(value)
        lines.append(f"  {json.dumps(key)}: {text}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


def encode_msgpack(m: Manifest) -> bytes:
    """msgpack map with the same keys, in the same order, as the JSON."""
    return msgspec.msgpack.encode(m)


def decode_manifest(data: bytes, fmt: str | None = None) -> Manifest:
    """A validated `Manifest` from JSON or msgpack bytes (`fmt` "json" | "msgpack" | None: sniff)."""
    if len(data) > MAX_FILE_BYTES:
        raise ManifestError("$", f"input is {len(data)} bytes or more; a manifest is at most {MAX_FILE_BYTES} bytes")
    fmt = fmt or _sniff(data)
    if fmt == "msgpack" and not _is_map_header(data[:1]):
        what = "it is empty" if not data else f"it starts with byte 0x{data[0]:02x}"
        raise ManifestError("$", f"not valid msgpack: {what}, not a msgpack map (a JSON file is named .json)")
    try:
        if fmt == "json":
            manifest = msgspec.json.decode(data, type=Manifest)
        else:
            manifest = msgspec.msgpack.decode(data, type=Manifest)
    except msgspec.ValidationError as exc:
        if fmt == "msgpack" and "got `unknown`" in str(exc):  # a byte no msgpack type uses (0xc1)
            raise ManifestError("$", f"not valid msgpack: {exc}") from None
        raise _refusal(exc) from None
    except msgspec.DecodeError as exc:
        raise ManifestError("$", f"not valid {'JSON' if fmt == 'json' else 'msgpack'}: {exc}") from None
    if fmt == "json":
        _refuse_duplicate_keys(data)
    else:
        _refuse_duplicate_msgpack_keys(data)
    return manifest


def load_manifest(source: str | os.PathLike[str] | bytes | bytearray | memoryview) -> Manifest:
    """A validated `Manifest` from a file path or from the file's bytes.

    A `str` is always a path. Raises `ManifestError` for anything wrong with the content,
    `ConfigError` for a source that is neither a path nor bytes, and `OSError` when the file
    cannot be read.

    Example:
        m = load_manifest("manifests/sensenova-u1-8b-batched-16.json")
        m.layout, m.max_seqs, m.maximum_capacity   # ("batched-sequence", 16, 32768)
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_manifest(bytes(source))
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"load_manifest takes a file path or the file's bytes, not {type(source).__name__}")
    path = Path(source)
    with path.open("rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)  # never more, whatever the file claims to be
    return decode_manifest(data, SUFFIXES.get(path.suffix.lower()))


def dump_manifest(m: Manifest, path: str | os.PathLike[str]) -> Path:
    """Write `m` to `path` as JSON (.json) or msgpack (.msgpack, .mpk); returns the path.

    The file is replaced atomically: a reader sees the old manifest or the new one, never half.
    """
    if not isinstance(m, Manifest):
        raise ConfigError(f"dump_manifest needs a Manifest, got {type(m).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"dump_manifest writes to a file path, not {type(path).__name__}")
    path = Path(path)
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot tell the format of {str(path)!r}; name it .json, .msgpack or .mpk")
    data = encode_json(m) if fmt == "json" else encode_msgpack(m)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a refused write leaves nothing behind
        raise
    return path


# ---- helpers --------------------------------------------------------------------------------------
def _sniff(data: bytes) -> str:
    head = data.lstrip(b" \t\r\n")[:1]
    if head in (b"{", b"["):
        return "json"
    if _is_map_header(head):
        return "msgpack"
    what = "it is empty" if not head else f"it starts with byte 0x{head[0]:02x}"
    raise ManifestError("$", f"not a manifest: {what}; expected a JSON object or a msgpack map")


def _is_map_header(head: bytes) -> bool:
    """Whether a first byte opens a msgpack map: fixmap, map16 or map32."""
    return bool(head) and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF))


def _refusal(exc: msgspec.ValidationError) -> ManifestError:
    """msgspec's `<message> - at `<path>`` as a ManifestError; our own refusals pass through."""
    if isinstance(exc.__cause__, ManifestError):
        return exc.__cause__
    match = _AT.fullmatch(str(exc))
    assert match is not None  # the pattern matches any string
    msg, path = match["msg"], match["path"] or "$"
    if found := re.fullmatch(r"Object contains unknown field `(.*)`", msg, re.S):
        fields = Manifest.__struct_fields__ if path == "$" else Layer.__struct_fields__
        return ManifestError(key_path(path, found[1]), f"unknown field; the fields here are {', '.join(fields)}")
    if found := re.fullmatch(r"Object missing required field `(.*)`", msg, re.S):
        return ManifestError(key_path(path, found[1]), "required field is missing")
    rule = msg[:1].lower() + msg[1:]
    choices = _ENUM_HINTS.get(re.split(r"[.\[]", path)[-1])
    if msg.startswith("Invalid enum value") and choices:
        rule += f"; use one of {', '.join(map(repr, choices))}"
    return ManifestError(path, rule)


class _Pairs(list):
    """A JSON object as its (key, value) pairs, duplicates kept."""


def _refuse_duplicate_keys(data: bytes) -> None:
    """msgspec keeps the last of two equal keys; another reader might keep the first. Refuse both."""

    def walk(node: object, path: str) -> None:
        if isinstance(node, _Pairs):
            seen: set[str] = set()
            for key, value in node:
                if key in seen:
                    raise ManifestError(key_path(path, key), "the key appears twice in one object")
                seen.add(key)
                walk(value, key_path(path, key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    # Runs only on input msgspec accepted, so depth and numbers are already bounded.
    walk(json.loads(data, object_pairs_hook=_Pairs), "$")


# msgpack tags (besides fixint, nil and bool) whose value has a fixed size after the tag: float32/64,
# uint8-64, int8-64, fixext 1-16 (a type byte and the payload)
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
          0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # fmt: skip
# tags followed by a big-endian count of this many bytes: str8/16/32, bin8/16/32, ext8/16/32 (bytes
# follow: for ext, after a type byte), array16/32, map16/32 (elements follow)
_COUNTED = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4,
            0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}  # fmt: skip


def _refuse_duplicate_msgpack_keys(data: bytes) -> None:
    """The JSON rule for msgpack too: msgspec keeps the last of two equal keys there as well.

    Walks the encoded maps and arrays, stepping over every other value by its header. Runs only on
    input msgspec accepted, so every header is whole and every key of a map is a string."""

    def end(at: int, path: str) -> int:
        """Offset just past the value that starts at `at`; refuses a map key seen twice."""
        tag = data[at]
        if tag <= 0x7F or tag >= 0xE0 or tag in (0xC0, 0xC2, 0xC3):
            return at + 1
        if tag in _FIXED:
            return at + 1 + _FIXED[tag]
        if 0xA0 <= tag <= 0xBF:  # fixstr
            return at + 1 + (tag & 0x1F)
        if tag <= 0x9F:  # fixmap, fixarray
            at, count = at + 1, tag & 0x0F
        else:
            width = _COUNTED[tag]
            at, count = at + 1 + width, int.from_bytes(data[at + 1 : at + 1 + width], "big")
            if tag not in (0xDC, 0xDD, 0xDE, 0xDF):  # str, bin, ext: bytes, not elements
                return at + count + (tag in (0xC7, 0xC8, 0xC9))
        is_map = tag <= 0x8F or tag in (0xDE, 0xDF)
        seen: set[str] = set()
        for i in range(count):
            if not is_map:
                at = end(at, f"{path}[{i}]")
                continue
            key_at, at = at, end(at, path)
            key = msgspec.msgpack.decode(data[key_at:at])
            if key in seen:
                raise ManifestError(key_path(path, key), "the key appears twice in one object")
            seen.add(key)
            at = end(at, key_path(path, key))
        return at

    end(0, "$")
