"""`batchkv export` and `batchkv inspect`, and the manifests shipped in manifests/."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import msgspec
import pytest

from batchkv.cli import main
from batchkv.manifest import Manifest, from_manifest, load_manifest
from batchkv.manifest.report import describe_ids, human_bytes
from batchkv.presets import KV_PRESETS

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "manifests").glob("*.json"))
ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
SCALE = {"float8_e4m3fn": 4}  # an fp32 scale per (position, kv head) beside e4m3 K and V


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def full_capacity_bytes(m: Manifest) -> int:
    """K+V bytes with every sequence at capacity in every layer (a ring layer: its ring) and each
    layer's scratch rows (min(16, tokens a step writes), none when steps are one token wide),
    computed from the file's fields alone."""
    seqs = m.max_seqs if m.layout == "batched-sequence" else 1
    step_tokens = seqs * m.max_write
    scratch = min(16, step_tokens) if step_tokens > 1 else 0
    rows = 0
    for e in m.layers:
        ring = e.policy == "ring"
        rows += seqs * (min(m.maximum_capacity, e.window + m.max_write - 1) if ring else m.maximum_capacity) + scratch
    kv = m.kv_dtype if isinstance(m.kv_dtype, str) else m.dtype
    return rows * 2 * m.kv_heads * (m.head_dim * ELEM[kv] + SCALE.get(kv, 0))


def test_export_kv_dtype_fp8_then_inspect_shows_e4m3_storage_and_its_bytes(tmp_path, capsys):
    out_path = tmp_path / "fp8.json"
    code, _, _ = run(
        capsys, "export", "--preset", "sensenova-u1-8b", "--kv-layout", "batched-sequence", "--max-kv-seqs", "4",
        "--capacity", "1024", "--kv-dtype", "float8_e4m3fn", "-o", str(out_path),
    )  # fmt: skip
    m = load_manifest(out_path)
    assert code == 0 and (m.dtype, m.kv_dtype) == ("bfloat16", "float8_e4m3fn")
    code, out, err = run(capsys, "inspect", str(out_path))
    assert (code, err) == (0, "")
    per_token = 42 * 2 * 8 * (128 + 4)  # e4m3 codes and one fp32 scale per (layer, K/V, head)
    assert f"({per_token} B: K+V of every layer, scales included)" in out
    assert f"{per_token / (42 * 2 * 8 * 128 * 2):.3f}x the bytes of bfloat16" in out
    assert f"({full_capacity_bytes(m)} B of K/V" in out
    cache = from_manifest(m, "meta", pool_rows=m.pool_rows(0))  # every sequence at capacity, allocated whole
    assert cache.nbytes == m.kv_bytes


@pytest.mark.parametrize("suffix", [".json", ".msgpack"])
def test_export_then_inspect_round_trips_through_the_file(tmp_path, capsys, suffix):
    out_path = tmp_path / f"tiny{suffix}"
    code, out, _ = run(
        capsys, "export", "--preset", "sensenova-u1-tiny", "--kv-layout", "batched-sequence", "--max-kv-seqs", "6",
        "--capacity", "1000", "--max-write", "16", "--window-every", "2", "--window", "64", "-o", str(out_path),
    )  # fmt: skip
    assert code == 0 and str(out_path) in out
    m = load_manifest(out_path)
    preset = KV_PRESETS["sensenova-u1-tiny"]
    assert (m.num_layers, m.kv_heads, m.head_dim, m.dtype) == (
        preset.num_layers,
        preset.kv_heads,
        preset.head_dim,
        preset.dtype,
    )
    assert (m.layout, m.max_seqs, m.maximum_capacity, m.max_write, m.segments) == ("batched-sequence", 6, 1000, 16, 12)
    assert [(e.layer_id, e.policy, e.window) for e in m.layers] == [
        (i, "ring", 64) if i % 2 else (i, "flat", 0) for i in range(preset.num_layers)
    ]
    assert m.step_widths == (1, 2, 4, 6) and m.model == "sensenova-u1-tiny"

    code, out, err = run(capsys, "inspect", str(out_path))
    assert (code, err) == (0, "")
    assert "batched-sequence" in out and "6 (+16 scratch rows)" in out
    table = [re.split(r"\s{2,}", line) for line in out.splitlines() if line[:1].isdigit()]
    per_layer_row = 2 * preset.kv_heads * preset.head_dim * ELEM[preset.dtype]  # one position of one layer
    ring_rows = 64 + 16 - 1  # window + max_write - 1
    assert [row[:4] for row in table] == [
        ["0-2 (even)", "flat", "-", "1000"],
        ["1-3 (odd)", "ring", "64", str(ring_rows)],
    ]
    assert [row[4] for row in table] == [
        human_bytes(2 * (6 * 1000 + 16) * per_layer_row),  # six sequences at capacity and the scratch rows
        human_bytes(2 * (6 * ring_rows + 16) * per_layer_row),
    ]
    per_token = 2 * preset.num_layers * preset.kv_heads * preset.head_dim * ELEM[preset.dtype]
    assert f"({per_token} B: K+V of every layer)" in out
    assert f"({full_capacity_bytes(m)} B of K/V" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-layout", "sequence", "--max-kv-seqs", "4"], "holds one sequence"),
        (["--kv-layout", "sequence", "--max-write", "200"], "$.max_write (--max-write): must be in [1, 100]"),
        (["--kv-layout", "batched-sequence", "--window", "64"], "give both"),
        (["--kv-layout", "sequence", "--max-segments", "4"], "does not take max_segments"),
        (
            ["--kv-layout", "batched-sequence", "--widths", "4,2"],
            "$.step_widths[1] (--widths): widths must be strictly",
        ),
        # The drafter's layer count, not the target's (was "$.num_layers: ..." naming no flag).
        (["--kv-layout", "batched-sequence", "--draft-layers", "0"], "$.drafter.num_layers (--draft-layers): must be"),
        (["--kv-layout", "batched-sequence", "--draft-layers", "1", "--spec-block", "1"], "$.block_size (--spec"),
    ],
)
def test_export_refuses_bad_options_with_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    out_path = tmp_path / "m.json"
    code, out, err = run(
        capsys, "export", "--preset", "sensenova-u1-tiny", "--capacity", "100", *argv, "-o", str(out_path)
    )
    assert code == 2 and out == ""
    assert err.startswith("batchkv export: ") and message in err and err.count("\n") == 1
    assert not out_path.exists()


def test_export_into_a_missing_folder_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "no" / "m.json"
    code, _, err = run(capsys, "export", "--preset", "sensenova-u1-tiny", "--kv-layout", "sequence",
                       "--capacity", "8", "-o", str(path))  # fmt: skip
    assert code == 2 and err == f"batchkv export: cannot write {path}: No such file or directory\n"


def test_export_needs_a_preset_or_the_whole_geometry(tmp_path, capsys):
    code, _, err = run(capsys, "export", "--num-layers", "4", "--kv-layout", "sequence", "--capacity", "8",
                       "-o", str(tmp_path / "m.json"))  # fmt: skip
    assert code == 2 and "--kv-heads" in err


def test_export_of_a_cell_pool_sizes_it_for_every_sequence_at_full_capacity(tmp_path, capsys):
    path = tmp_path / "cell.json"
    argv = ["export", "--preset", "sensenova-u1-tiny", "--kv-layout", "cell", "--max-kv-seqs", "3", "--capacity", "50"]
    assert run(capsys, *argv, "-o", str(path))[0] == 0
    m = load_manifest(path)
    assert (m.layout, m.max_cells, m.max_seqs) == ("cell", 150, msgspec.UNSET)
    code, out, _ = run(capsys, "inspect", str(path))
    assert code == 0 and "shared pool of 150 cells" in out


def test_inspect_exits_2_with_one_line_for_a_missing_file(tmp_path, capsys):
    path = tmp_path / "absent.json"
    code, out, err = run(capsys, "inspect", str(path))
    assert (code, out) == (2, "")
    assert err == f"batchkv inspect: {path}: cannot read: No such file or directory\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"version": 1, "layout": ', "$: not valid JSON"),
        (b"{}", "$.version: required field is missing"),
        (b"\xff", "$: not valid JSON"),
    ],
)
def test_inspect_exits_2_with_one_line_for_a_broken_file(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    code, out, err = run(capsys, "inspect", str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"batchkv inspect: {path}: {message}") and err.count("\n") == 1
    assert "Traceback" not in err


def test_inspect_names_the_broken_field_of_an_otherwise_good_file(tmp_path, capsys):
    doc = json.loads(SHIPPED[0].read_text())
    doc["layers"][3].update(policy="ring", window=0)
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(doc))
    code, _, err = run(capsys, "inspect", str(path))
    assert code == 2
    assert (
        err
        == f"batchkv inspect: {path}: $.layers[3].window: a ring layer needs window > 0 (the ring holds that window)\n"
    )


def test_inspect_keeps_a_hostile_message_on_one_line(tmp_path, capsys):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"version": 1, "lay\nout": 1}))
    code, _, err = run(capsys, "inspect", str(path))
    assert code == 2 and err.count("\n") == 1 and '$["lay\\nout"]: unknown field' in err


# ---- shipped manifests --------------------------------------------------------------------------
def test_the_four_promised_manifests_are_shipped():
    names = {p.name for p in SHIPPED}
    assert {
        "sensenova-u1-8b-sequence.json",
        "sensenova-u1-8b-batched-16.json",
        "sensenova-u1-8b-batched-64.json",
        "sliding-window-example-batched-32.json",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_each_shipped_manifest_validates_inspects_and_builds(path, capsys):
    m = load_manifest(path)
    assert run(capsys, "inspect", str(path))[0] == 0
    # Full geometry on the meta device (no memory), then a tiny CPU build of the same layer pattern.
    cache = from_manifest(m, "meta", pool_rows=max(m.pool_rows(e.layer_id) for e in m.layers))  # allocated whole
    assert cache.nbytes == full_capacity_bytes(m) == m.kv_bytes
    fewer = {"max_seqs": 2} if m.layout == "batched-sequence" else {}
    tiny = from_manifest(m, "cpu", capacity=64, max_write=8, **fewer)
    shapes = {tuple(tiny.k_store(i).shape[1:]) for i in range(m.num_layers)}
    assert shapes == {(1, m.kv_heads, m.head_dim)}
    assert tiny.config.layers == cache.config.layers


def test_sensenova_manifests_use_the_sensenova_kv_geometry():
    # DESIGN.md: 42 layers, 8 KV heads, head_dim 128, bf16, no sliding window; 42*2*8*128*2 B per token.
    sensenova = [m for m in map(load_manifest, SHIPPED) if m.model == "sensenova-u1-8b"]
    assert len(sensenova) == 4
    for m in sensenova:
        assert (m.num_layers, m.kv_heads, m.head_dim, m.dtype) == (42, 8, 128, "bfloat16")
        assert all(e.policy == "flat" and e.window == 0 for e in m.layers)
        e4m3 = m.kv_dtype == "float8_e4m3fn"
        assert m.bytes_per_token == (42 * 2 * 8 * (128 + 4) if e4m3 else 42 * 2 * 8 * 128 * 2)


def readme_commands() -> list[list[str]]:
    text = (ROOT / "manifests" / "README.md").read_text()
    return [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("batchkv export ")]


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: argv[-1])
def test_each_shipped_manifest_is_what_its_documented_command_writes(tmp_path, capsys, argv):
    shipped = ROOT / argv[-1]
    out_path = tmp_path / shipped.name
    assert run(capsys, *argv[:-1], str(out_path))[0] == 0
    assert out_path.read_bytes() == shipped.read_bytes()


def test_every_shipped_manifest_has_a_documented_command():
    assert sorted(Path(argv[-1]).name for argv in readme_commands()) == sorted(p.name for p in SHIPPED)


def test_layer_ids_print_as_ranges_parities_steps_or_runs():
    assert describe_ids(list(range(42))) == "0-41"
    assert describe_ids(list(range(1, 32, 2))) == "1-31 (odd)"
    assert describe_ids(list(range(5, 42, 6))) == "5-41 (step 6)"
    assert describe_ids([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert describe_ids([9]) == "9"


def test_human_bytes_uses_binary_units():
    assert [human_bytes(n) for n in (512, 172032, 3 * 2**30)] == ["512 B", "168.0 KiB", "3.0 GiB"]
