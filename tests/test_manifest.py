"""Manifest schema, codec and from_manifest: round trips, every rule once, fuzzing, built geometry."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchkv
from batchkv.cache import LayerSpec
from batchkv.errors import ConfigError, ManifestError, UnsupportedLayout
from batchkv.manifest import (
    Layer,
    Manifest,
    decode_manifest,
    dump_manifest,
    encode_json,
    encode_msgpack,
    from_manifest,
    load_manifest,
    make_manifest,
)
from batchkv.manifest.codec import MAX_FILE_BYTES

ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
TORCH = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_doc(layout: str = "batched-sequence") -> dict:
    """A small valid manifest as plain JSON data: 4 layers, layer 3 a ring."""
    doc = {
        "version": 1,
        "layout": layout,
        "model": "tiny",
        "num_layers": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "dtype": "float32",
        "maximum_capacity": 256,
        "max_write": 8,
        "max_sample_rows": 64,
        "step_widths": [1, 2, 4],
        "layers": [{"layer_id": i, "policy": "flat", "window": 0} for i in range(3)]
        + [{"layer_id": 3, "policy": "ring", "window": 16}],
    }
    if layout == "batched-sequence":
        doc.update(max_seqs=4, max_segments=8, causal=True)
    if layout == "cell":
        doc["max_cells"] = 1024
    return doc


def decode_doc(doc: object) -> Manifest:
    return decode_manifest(json.dumps(doc).encode())


def sample_manifests() -> list[Manifest]:
    return [
        decode_doc(valid_doc("batched-sequence")),
        decode_doc(valid_doc("sequence")),
        decode_doc(valid_doc("cell")),
        decode_doc({k: v for k, v in valid_doc().items() if k not in ("model", "max_segments", "causal")}),
        make_manifest(layout="batched-sequence", num_layers=6, kv_heads=8, head_dim=128, dtype="bfloat16",
                      capacity=4096, max_seqs=3, window_every=3, window=1000, causal=False, model="módel ✓"),
        decode_doc({**valid_doc(), "layers": valid_doc()["layers"][::-1]}),  # listed in any order
        decode_doc({**valid_doc(), "kv_dtype": "float8_e4m3fn"}),  # e4m3 storage, fp32 scales beside it
    ]  # fmt: skip


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("m", sample_manifests(), ids=lambda m: f"{m.layout}-{m.num_layers}")
def test_json_and_msgpack_round_trip_exactly(m):
    as_json, as_msgpack = encode_json(m), encode_msgpack(m)
    assert decode_manifest(as_json) == m
    assert decode_manifest(as_msgpack) == m
    assert encode_json(decode_manifest(as_json)) == as_json
    assert encode_msgpack(decode_manifest(as_msgpack)) == as_msgpack
    assert json.loads(as_json) == msgspec.msgpack.decode(as_msgpack)


def test_json_keys_follow_the_schema_order_one_layer_per_line():
    m = sample_manifests()[0]
    text = encode_json(m).decode()
    assert list(json.loads(text)) == [f for f in Manifest.__struct_fields__ if getattr(m, f) is not msgspec.UNSET]
    assert sum(line.strip().startswith('{"layer_id"') for line in text.splitlines()) == m.num_layers


def test_absent_optional_fields_stay_absent_and_take_their_defaults():
    doc = {k: v for k, v in valid_doc().items() if k not in ("max_segments", "causal", "max_sample_rows")}
    m = decode_doc(doc)
    assert (m.segments, m.is_causal, m.max_sample_rows) == (2 * doc["max_seqs"], True, 64)
    assert "max_segments" not in json.loads(encode_json(m)) and "causal" not in json.loads(encode_json(m))


@pytest.mark.parametrize("suffix", [".json", ".msgpack", ".mpk"])
def test_dump_then_load_returns_the_same_manifest_and_bytes_sniff_the_format(tmp_path, suffix):
    m = sample_manifests()[0]
    path = dump_manifest(m, tmp_path / f"m{suffix}")
    assert load_manifest(path) == m
    assert load_manifest(str(path)) == m
    assert load_manifest(path.read_bytes()) == m  # no extension: the first byte tells
    (tmp_path / "m.bin").write_bytes(path.read_bytes())
    assert load_manifest(tmp_path / "m.bin") == m


def test_dump_refuses_an_unknown_extension(tmp_path):
    with pytest.raises(ConfigError, match=r"\.json, \.msgpack or \.mpk"):
        dump_manifest(sample_manifests()[0], tmp_path / "m.yaml")
    assert not list(tmp_path.iterdir())


# ---- every rule, broken once ----------------------------------------------------------------------
def _set(**kw):
    return lambda d: d.update(kw)


def _drop(key):
    return lambda d: d.pop(key)


def _layer(i, **kw):
    return lambda d: d["layers"][i].update(kw)


RULES = [
    ("version", _set(version=2), "$.version", "reads manifest version 1, not 2"),
    ("version type", _set(version="1"), "$.version", "expected `int`, got `str`"),
    ("layout", _set(layout="paged"), "$.layout", "use one of 'sequence', 'cell', 'batched-sequence'"),
    ("unknown field", _set(extra=1), "$.extra", "unknown field"),
    ("odd unknown field", lambda d: d.update({"a b": 1}), '$["a b"]', "unknown field"),
    ("missing field", _drop("layers"), "$.layers", "required field is missing"),
    ("bool for int", _set(num_layers=True), "$.num_layers", "expected `int`, got `bool`"),
    ("float for int", _set(kv_heads=2.0), "$.kv_heads", "expected `int`, got `float`"),
    ("num_layers low", _set(num_layers=0), "$.num_layers", "must be in [1, 1024]"),
    ("kv_heads high", _set(kv_heads=257), "$.kv_heads", "must be in [1, 256]"),
    ("head_dim high", _set(head_dim=2048), "$.head_dim", "must be in [1, 1024]"),
    ("dtype", _set(dtype="int8"), "$.dtype", "use one of 'bfloat16', 'float16', 'float32'"),
    ("dtype e4m3", _set(dtype="float8_e4m3fn"), "$.dtype", "use one of 'bfloat16', 'float16', 'float32'"),
    ("kv_dtype", _set(kv_dtype="float8_e5m2"), "$.kv_dtype",
     "use one of 'bfloat16', 'float16', 'float32', 'float8_e4m3fn'"),
    ("kv_dtype type", _set(kv_dtype=8), "$.kv_dtype", "expected `str`, got `int`"),
    ("capacity low", _set(maximum_capacity=0), "$.maximum_capacity", "must be in [1, 16777216]"),
    ("capacity high", _set(maximum_capacity=1 << 25), "$.maximum_capacity", "must be in [1, 16777216]"),
    ("max_write > capacity", _set(max_write=257), "$.max_write", "must be in [1, 256] (maximum_capacity"),
    ("max_write zero", _set(max_write=0), "$.max_write", "must be in [1, 256]"),
    ("step tokens", _set(max_seqs=4096, max_segments=4096, maximum_capacity=4096, max_write=257),
     "$.max_write", "max_seqs * max_write may be at most 1048576"),
    ("max_seqs missing", _drop("max_seqs"), "$.max_seqs", "needs max_seqs"),
    ("max_seqs zero", _set(max_seqs=0), "$.max_seqs", "must be in [1, 4096]"),
    ("max_segments < max_seqs", _set(max_segments=3), "$.max_segments", "must be in [4, 65536] (max_seqs"),
    ("causal type", _set(causal="yes"), "$.causal", "expected `bool`, got `str`"),
    ("model empty", _set(model=""), "$.model", "printable name of 1 to 128 characters"),
    ("model control char", _set(model="a\nb"), "$.model", "printable name"),
    ("model type", _set(model=5), "$.model", "expected `str`, got `int`"),
    ("sample rows", _set(max_sample_rows=0), "$.max_sample_rows", "must be in [1, 4096]"),
    ("widths order", _set(step_widths=[1, 4, 2]), "$.step_widths[2]", "strictly increasing; 2 follows 4"),
    ("widths duplicate", _set(step_widths=[1, 1]), "$.step_widths[1]", "strictly increasing"),
    ("widths zero", _set(step_widths=[0, 1]), "$.step_widths[0]", "must be in [1, 32]"),
    ("widths past step", _set(step_widths=[1, 33]), "$.step_widths[1]", "must be in [1, 32]"),
    ("widths count", _set(step_widths=list(range(1, 258))), "$.step_widths", "at most 256 captured widths"),
    ("layers count", lambda d: d["layers"].pop(), "$.layers", "has 3 entries; num_layers is 4"),
    ("layers type", _set(layers={}), "$.layers", "expected `array`, got `object`"),
    ("layer id twice", _layer(2, layer_id=1), "$.layers[2].layer_id", "1 is already used by $.layers[1]"),
    ("layer id range", _layer(3, layer_id=4), "$.layers[3].layer_id", "must be in [0, 3]"),
    ("ring window zero", _layer(3, window=0), "$.layers[3].window", "a ring layer needs window > 0"),
    ("window negative", _layer(1, window=-1), "$.layers[1].window", "must be in [0, 16777216]"),
    ("policy", _layer(0, policy="paged"), "$.layers[0].policy", "use one of 'flat', 'ring'"),
    ("layer unknown field", _layer(1, extra=0), "$.layers[1].extra", "unknown field"),
    ("layer missing field", lambda d: d["layers"][1].pop("policy"), "$.layers[1].policy", "required field"),
    ("kv bytes", _set(maximum_capacity=1 << 24, max_write=1, kv_heads=256, head_dim=1024),
     "$.maximum_capacity", "the bound is 1099511627776 bytes (1 TiB)"),
    ("not an object", lambda d: d.clear(), "$.version", "required field is missing"),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "path", "rule"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_broken_rule_is_refused_with_its_path_and_rule(mutate, path, rule):
    doc = valid_doc()
    mutate(doc)
    for data in (json.dumps(doc).encode(), msgspec.msgpack.encode(doc)):
        with pytest.raises(ManifestError) as info:
            decode_manifest(data)
        assert info.value.path == path
        assert rule in info.value.rule
        assert str(info.value) == f"{path}: {info.value.rule}"


LAYOUT_RULES = [
    ("sequence", _set(max_seqs=1), "$.max_seqs", "only layout 'batched-sequence' takes max_seqs"),
    ("sequence", _set(causal=True), "$.causal", "only layout 'batched-sequence' takes causal"),
    ("sequence", _set(max_cells=64), "$.max_cells", "only layout 'cell' takes max_cells"),
    ("batched-sequence", _set(max_cells=64), "$.max_cells", "layout is 'batched-sequence' (remove it)"),
    ("cell", _set(max_segments=8), "$.max_segments", "only layout 'batched-sequence' takes max_segments"),
    ("cell", _drop("max_cells"), "$.max_cells", "layout 'cell' needs max_cells"),
    ("cell", _set(max_cells=7), "$.max_cells", "must be in [8, 67108864] (max_write"),
    ("sequence", _set(step_widths=[1, 16]), "$.step_widths[1]", "must be in [1, 8]"),
]


@pytest.mark.parametrize(("layout", "mutate", "path", "rule"), LAYOUT_RULES)
def test_layout_specific_fields_are_refused_on_other_layouts(layout, mutate, path, rule):
    doc = valid_doc(layout)
    mutate(doc)
    with pytest.raises(ManifestError) as info:
        decode_doc(doc)
    assert (info.value.path, rule in info.value.rule) == (path, True)


@pytest.mark.parametrize(
    ("data", "rule"),
    [
        (b'{"version": 1,', "not valid JSON"),
        (b"\x81\xa7version", "not valid msgpack"),
        (b"", "it is empty"),
        (b"version: 1\n", "starts with byte 0x76"),
        (b"[1, 2]", "expected `object`, got `array`"),
    ],
)
def test_input_that_is_no_manifest_at_all_is_refused_at_the_root(data, rule):
    with pytest.raises(ManifestError) as info:
        decode_manifest(data)
    assert info.value.path == "$" and rule in info.value.rule


def test_a_key_given_twice_is_refused_rather_than_silently_resolved():
    text = json.dumps(valid_doc()).replace('"window": 16', '"window": 16, "window": 32')
    with pytest.raises(ManifestError, match=r"^\$\.layers\[3\]\.window: the key appears twice"):
        decode_manifest(text.encode())


def _msgpack_map(pairs: list[tuple[str, object]]) -> bytes:
    """A msgpack map of these pairs in this order, duplicates kept (map16 header)."""
    body = b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in pairs)
    return b"\xde" + len(pairs).to_bytes(2, "big") + body


def test_a_key_given_twice_in_msgpack_is_refused_as_in_json():
    doc = valid_doc()
    layers = [msgspec.Raw(_msgpack_map(list(entry.items()))) for entry in doc["layers"]]
    with_layers = lambda: [(k, layers if k == "layers" else v) for k, v in doc.items()]  # noqa: E731
    assert decode_manifest(_msgpack_map(with_layers())) == decode_doc(doc)  # maps written by hand walk clean
    with pytest.raises(ManifestError, match=r"^\$\.max_write: the key appears twice"):  # was: the last one won
        decode_manifest(_msgpack_map([*doc.items(), ("max_write", 4)]))
    entry = doc["layers"][3]
    layers[3] = msgspec.Raw(_msgpack_map([*entry.items(), ("window", entry["window"] * 2)]))
    with pytest.raises(ManifestError, match=r"^\$\.layers\[3\]\.window: the key appears twice"):
        decode_manifest(_msgpack_map(with_layers()))


def test_a_file_past_the_size_bound_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "huge.json"
    with path.open("wb") as f:
        f.truncate(MAX_FILE_BYTES * 4)  # sparse: reading it whole would take 16 MiB
    with pytest.raises(ManifestError, match=f"at most {MAX_FILE_BYTES} bytes"):
        load_manifest(path)


def test_python_construction_and_replace_are_checked_like_decoding():
    good = sample_manifests()[0]
    with pytest.raises(ManifestError, match=r"^\$\.layers\[3\]\.window: a ring layer needs window > 0"):
        msgspec.structs.replace(good, layers=(*good.layers[:3], Layer(3, "ring", 0)))
    with pytest.raises(ManifestError, match=r"^\$\.kv_heads: expected an integer, got str"):
        msgspec.structs.replace(good, kv_heads="2")
    with pytest.raises(ManifestError, match=r"^\$\.layers: expected a tuple"):
        msgspec.structs.replace(good, layers=list(good.layers))
    with pytest.raises(AttributeError):
        good.kv_heads = 3


# ---- fuzzing: nothing but a Manifest or a ManifestError -------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELDS = [*Manifest.__struct_fields__, "layer_id", "policy", "window"]


def _encodings(doc: object) -> list[bytes]:
    """JSON always; msgpack too unless an integer is past its 64-bit range."""
    try:
        return [json.dumps(doc).encode(), msgspec.msgpack.encode(doc)]
    except OverflowError:
        return [json.dumps(doc).encode()]


def _only_manifest_or_manifest_error(data: bytes) -> None:
    try:
        m = decode_manifest(data)
    except ManifestError as exc:
        assert exc.path.startswith("$") and exc.rule
        return
    assert isinstance(m, Manifest)
    assert decode_manifest(encode_json(m)) == m == decode_manifest(encode_msgpack(m))


@FUZZ
@given(json_values)
def test_random_json_documents_give_a_manifest_or_a_manifest_error(value):
    _only_manifest_or_manifest_error(json.dumps(value).encode())


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=12))
def test_random_objects_with_manifest_keys_give_a_manifest_or_a_manifest_error(doc):
    for data in _encodings(doc):
        _only_manifest_or_manifest_error(data)


@FUZZ
@given(
    layout=st.sampled_from(["sequence", "cell", "batched-sequence"]),
    edits=st.lists(
        st.tuples(st.integers(-1, 3), st.sampled_from([*FIELDS, "other"]), st.booleans(), json_values | st.integers()),
        min_size=1,
        max_size=3,
    ),
)
def test_mutations_of_a_valid_manifest_give_a_manifest_or_a_manifest_error(layout, edits):
    doc = copy.deepcopy(valid_doc(layout))
    for layer, key, delete, value in edits:
        layers = doc.get("layers")
        nested = isinstance(layers, list) and 0 <= layer < len(layers) and isinstance(layers[layer], dict)
        target = layers[layer] if nested else doc  # an earlier edit may have replaced the layers
        if delete:
            target.pop(key, None)
        else:
            target[key] = value
    for data in _encodings(doc):
        _only_manifest_or_manifest_error(data)


@FUZZ
@given(st.binary(max_size=64))
def test_random_bytes_give_a_manifest_or_a_manifest_error(data):
    _only_manifest_or_manifest_error(data)


# ---- from_manifest: the built cache matches the manifest ------------------------------------------
def _expected_rows(m: Manifest, layer_id: int) -> int:
    entry = next(e for e in m.layers if e.layer_id == layer_id)
    if entry.policy == "ring":
        return min(m.maximum_capacity, entry.window + m.max_write - 1)
    return m.maximum_capacity


def assert_geometry(cache, m: Manifest) -> None:
    """Every layer's K and V pools are [rows, 1, kv_heads, head_dim] of the storage dtype, with fp32
    scales [rows, 1, kv_heads] beside e4m3 ones; allocated whole at full capacity (`pool_rows`) they
    hold every sequence at capacity (a ring layer: its ring) and the scratch rows, the manifest's
    `kv_bytes`."""
    seqs = m.max_seqs if m.layout == "batched-sequence" else 1
    assert (cache.max_seqs, cache.capacity, cache.config.max_write) == (seqs, m.maximum_capacity, m.max_write)
    assert cache.config.max_segments == (m.max_segments if isinstance(m.max_segments, int) else 2 * seqs)
    by_id = {e.layer_id: e for e in m.layers}
    assert cache.config.layers == tuple(LayerSpec(by_id[i].policy, by_id[i].window) for i in range(m.num_layers))
    assert cache.config.scratch_rows == m.scratch_rows == (min(16, seqs * m.max_write) if seqs * m.max_write > 1 else 0)
    full = from_manifest(m, "meta", pool_rows=max(m.pool_rows(i) for i in by_id))  # allocated whole
    for layer_id in range(m.num_layers):
        rows = seqs * _expected_rows(m, layer_id) + m.scratch_rows
        assert m.pool_rows(layer_id) == rows
        shape = (rows, 1, m.kv_heads, m.head_dim)
        for store in (full.k_store(layer_id), full.v_store(layer_id)):
            assert tuple(store.shape) == shape and store.dtype == TORCH[m.storage_dtype]
        scales = [t for name, t in full.planes(layer_id).items() if name.endswith("_scale")]
        assert [(tuple(t.shape), t.dtype) for t in scales] == [(shape[:3], torch.float32)] * len(scales)
        assert len(scales) == (2 if m.storage_dtype == "float8_e4m3fn" else 0)
    expected_rows = sum(seqs * _expected_rows(m, i) + m.scratch_rows for i in range(m.num_layers))
    scale_bytes = 4 if m.storage_dtype == "float8_e4m3fn" else 0
    expected_bytes = expected_rows * 2 * m.kv_heads * (m.head_dim * ELEM[m.storage_dtype] + scale_bytes)
    assert full.nbytes == expected_bytes == m.kv_bytes
    assert (cache.config.dtype, cache.config.kv_dtype) == (TORCH[m.dtype], TORCH[m.storage_dtype])


@pytest.mark.parametrize("m", [m for m in sample_manifests() if m.layout != "cell"], ids=lambda m: m.layout)
def test_the_built_cache_has_the_manifest_geometry(m):
    assert_geometry(from_manifest(m, "meta"), m)


def test_from_manifest_reads_paths_and_bytes_and_is_exported_at_the_top(tmp_path):
    m = sample_manifests()[0]
    path = dump_manifest(m, tmp_path / "m.msgpack")
    for source in (path, str(path), path.read_bytes(), m):
        assert_geometry(batchkv.from_manifest(source, "meta"), m)


def test_kv_dtype_is_optional_defaults_to_dtype_and_an_e4m3_manifest_counts_its_scales():
    plain, e4m3 = decode_doc(valid_doc()), decode_doc({**valid_doc(), "kv_dtype": "float8_e4m3fn"})
    assert plain.kv_dtype is msgspec.UNSET and plain.storage_dtype == plain.dtype == "float32"
    assert "kv_dtype" not in json.loads(encode_json(plain))  # files written before the field stay byte for byte
    # 4 layers x K and V x 2 heads: 32 fp32 elements, or 32 e4m3 codes plus one fp32 scale per head
    assert plain.bytes_per_token == 4 * 2 * 2 * 32 * 4
    assert e4m3.bytes_per_token == 4 * 2 * 2 * (32 + 4)
    assert decode_doc({**valid_doc(), "kv_dtype": "float32"}).bytes_per_token == plain.bytes_per_token


def test_from_manifest_takes_dtype_overrides_by_name():
    cache = from_manifest(sample_manifests()[0], "meta", kv_dtype="float8_e4m3fn", dtype="bfloat16")
    assert (cache.config.dtype, cache.config.kv_dtype) == (torch.bfloat16, torch.float8_e4m3fn)
    assert set(cache.planes(0)) == {"k", "v", "k_scale", "v_scale"}


def test_a_cell_manifest_is_refused_with_the_layout_to_export_instead():
    with pytest.raises(UnsupportedLayout, match="--kv-layout batched-sequence"):
        from_manifest(decode_doc(valid_doc("cell")))


def test_overrides_shrink_the_cache_and_bad_overrides_are_refused():
    m = sample_manifests()[0]
    cache = from_manifest(m, "cpu", max_seqs=2, capacity=32)
    assert (cache.max_seqs, cache.capacity, cache.config.max_segments) == (2, 32, 4)
    assert cache.config.ring_rows(3) == min(32, 16 + m.max_write - 1)
    with pytest.raises(ConfigError, match="unknown override"):
        from_manifest(m, "meta", columns=3)
    with pytest.raises(ConfigError, match="holds one sequence"):
        from_manifest(decode_doc(valid_doc("sequence")), "meta", max_seqs=2)


def test_a_built_cache_attends_like_torch_sdpa_on_flat_and_ring_layers():
    # Manifest -> cache -> one prefill step; each layer's output against torch SDPA with the same mask.
    m = make_manifest(layout="sequence", num_layers=2, kv_heads=2, head_dim=32, dtype="float32",
                      capacity=64, max_write=12, window_every=2, window=5)  # fmt: skip
    cache = from_manifest(m, "cpu", attention="reference")
    torch.manual_seed(0)
    n, hq = 12, 4
    seq = cache.seq_new()
    cache.declare_step([seq] * n)
    cache.prepare_step(n)
    for layer, window in ((0, 0), (1, 5)):
        q, k, v = torch.randn(n, hq, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)
        out = cache.update_and_attend(layer, q, k, v, causal=m.is_causal)
        i = torch.arange(n)
        mask = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
            attn_mask=mask,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(out, ref)
    cache.commit_step()
    assert cache.pos(seq) == n
