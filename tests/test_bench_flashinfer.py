"""The FlashInfer peer's CPU parts: the paged K/V it builds from a case's column store, read back the way
FlashInfer's docs define its page table; its candidates run by the benchmark against a stand-in for
FlashInfer's wrappers (torch attention over the page table as those docs define it); its JIT
environment on a stand-in toolkit; and the kernel benchmark's smoke run without FlashInfer (the peer
recorded as unavailable, the others timed)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from bench.kernel_bench import run_peer
from bench.lib import flashinfer_jit
from bench.lib.flashinfer_peer import PAGE_SIZES, at_page, flashinfer, page_size, page_table, paged_kv
from bench.lib.kernel_cases import SMALL, Case, build_cases
from bench.lib.timing import Deadline

ROOT = Path(__file__).resolve().parents[1]


def _read_back(kv: torch.Tensor, table, b: int, plane: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's positions as FlashInfer reads them (pages indices[indptr[b]:indptr[b + 1]], all full
    but the last, which holds last_page_len[b]), and what its pages hold past them."""
    pages = [int(p) for p in table.indices[int(table.indptr[b]) : int(table.indptr[b + 1])]]
    rows = torch.cat([kv[p, plane] for p in pages])  # [pages * page, Hkv, D]
    valid = (len(pages) - 1) * table.page + int(table.last_page_len[b])
    return rows[:valid], rows[valid:]


@pytest.mark.parametrize("name", ["b4-mixed", "b8-l40", "b4-verify4", "prefill-2x32"])
@pytest.mark.parametrize("size", PAGE_SIZES)
def test_paged_kv_holds_each_sequences_keys_and_values_where_its_page_table_points(name, size):
    geo, cases = build_cases([name], small=True, l2_bytes=1 << 16)
    case = cases[name]
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d)
    v = torch.randn_like(k)
    table = page_table(case.lengths, case.q_len, page_size(case.lengths, size))
    kv = paged_kv(k, v, case.cols[-1], case.lengths, table)  # the last rotation: other columns than rotation 0's
    assert kv.shape == (len(table.indices), 2, table.page, geo.hkv, geo.d)
    assert table.qo_indptr.tolist() == [b * case.q_len for b in range(case.batch + 1)]
    for b, (col, n) in enumerate(zip(case.cols[-1], case.lengths, strict=True)):
        assert 1 <= int(table.last_page_len[b]) <= table.page
        for plane, store in enumerate((k, v)):
            seq, past = _read_back(kv, table, b, plane)
            assert torch.equal(seq, store[:n, col])
            assert not past.any()
    if size == 0:
        assert table.page % 16 == 0 and table.indptr.diff().tolist() == [1] * case.batch


class _Paged:
    """FlashInfer's paged wrappers as documented, in torch: `plan` keeps the page table (decode: 7 positional
    arguments, prefill: qo_indptr first), `run(q, kv, out=)` attends each sequence's queries (bottom-right
    causal) to the positions its pages hold. "auto" resolves as FlashInfer's does: FA3 past 64 queries."""

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, backend="auto", **buffers):
        assert layout == "NHD" and use_cuda_graph and workspace.dtype == torch.uint8
        self._backend, self.tensor_cores = backend, use_tensor_cores

    def plan(self, *args, causal=False, pos_encoding_mode="NONE", q_data_type=None, kv_data_type=None,
             uniform_q_len=None):  # fmt: skip
        qo, (indptr, indices, last, self.hq, self.hkv, self.d, self.page) = (None, args) if len(args) == 7 else (
            args[0], args[1:])  # fmt: skip
        self.qo = qo if qo is not None else torch.arange(len(last) + 1)
        self.table, self.causal = (indptr, indices, last), causal
        q_len = int(self.qo.diff().max())
        assert uniform_q_len in (None, q_len) and pos_encoding_mode == "NONE" and q_data_type == kv_data_type
        if self._backend == "auto":
            self._backend = "fa3" if q_len > 64 else "fa2"

    def run(self, q, kv, out):
        indptr, indices, last = self.table
        for b in range(len(last)):
            pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
            n = (len(pages) - 1) * self.page + int(last[b])
            keys, values = (kv[pages, plane].reshape(-1, self.hkv, self.d)[:n] for plane in (0, 1))
            rows = slice(int(self.qo[b]), int(self.qo[b + 1]))
            out[rows] = _attend(q[rows], keys, values, self.causal)
        return out


def _attend(q, k, v, causal):
    """q [q_len, Hq, D] over k, v [n, Hkv, D]; query i sees keys 0..n - q_len + i when causal."""
    mask = torch.arange(len(k))[None] <= len(k) - len(q) + torch.arange(len(q))[:, None] if causal else None
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                       enable_gqa=True)  # fmt: skip
    return o.transpose(0, 1)


STAND_IN = SimpleNamespace(
    BatchDecodeWithPagedKVCacheWrapper=_Paged,
    BatchPrefillWithPagedKVCacheWrapper=_Paged,
    single_decode_with_kv_cache=lambda q, k, v, kv_layout: _attend(q[None], k, v, causal=False)[0],
)


def _named(config: dict) -> tuple:
    """(page size, tensor cores) of a decode candidate, (page size, "asked [picked] [uniform]") of a prefill one."""
    if "tensor_cores" in config:
        return config["page_size"], config["tensor_cores"]
    if "asked" not in config:
        return None, None  # single decode
    picked = [config["backend"]] if config["asked"] == "auto" else []
    return config["page_size"], " ".join([config["asked"], *picked, *["uniform"] * config["uniform_q_len"]])


def test_the_candidates_run_by_the_benchmark_match_the_reference_and_name_each_variant(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    geo, cases = build_cases(["b1-l200", "b4-verify4"], small=True, l2_bytes=1 << 16)
    cases["prefill-1x96"] = Case("prefill-1x96", 1, 96, [160], SMALL, 1 << 16, torch.Generator().manual_seed(1))
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d)
    v = torch.randn_like(k)
    pages = [16, 32, 64]
    expected = {
        "b1-l200": [(p, tc) for p in [*pages, 208] for tc in (False, True)] + [(None, None)],  # + single decode
        "b4-verify4": [(p, b) for p in [*pages, page_size(cases["b4-verify4"].lengths, 0)]
                       for b in ("auto fa2", "fa3", "fa2 uniform")],  # auto picked fa2: not asked again
        "prefill-1x96": [(p, b) for p in [*pages, 160] for b in ("auto fa3", "fa2")],
    }  # fmt: skip
    for name, case in cases.items():
        entry: dict = {"peers": {}, "peer_candidates": {}}
        report = {"copy_gbps": 1.0, "read_gbps": 1.0}
        run_peer(entry, "flashinfer", flashinfer(STAND_IN, {}, case, k, v), case, k, v, Deadline(60), report)
        tried = entry["peer_candidates"]["flashinfer"]
        assert all(r["max_abs_err"] < 1e-5 and r["us"] > 0 for r in tried), tried
        assert [_named(r["config"]) for r in tried] == expected[name]
        best = entry["peers"]["flashinfer"]
        assert best["us"] == min(r["us"] for r in tried) and best["config"]["max_abs_err"] < 1e-5


def test_the_peer_is_unavailable_on_the_cpu_and_refuses_every_case_with_the_reason():
    fi, info = flashinfer_jit.load(torch.float32, 32, torch.device("cpu"), timeout_s=300)
    assert fi is None and info == {"available": False, "why": "no CUDA device (the cases are on the CPU)"}
    assert flashinfer_jit.load(torch.bfloat16, 128, torch.device("cpu"), timeout_s=0)[1]["why"].startswith("left out")
    geo, cases = build_cases(["b1-l200"], small=True, l2_bytes=1 << 16)
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d)
    with pytest.raises(RuntimeError, match="unavailable: no CUDA device"):
        next(flashinfer(fi, info, cases["b1-l200"], k, k))


def test_at_page_keeps_the_fastest_timed_candidate_of_that_page_size():
    tried = [
        {"config": {"page_size": 16}, "us": 9.0},
        {"config": {"page_size": 16}, "refused": "disagrees with the reference"},
        {"config": {"page_size": 16}, "us": 7.5},
        {"config": {"page_size": 32}, "us": 5.0},
        {"config": {"api": "single_decode_with_kv_cache"}, "us": 4.0},
    ]
    assert at_page(tried, 16) == 7.5 and at_page(tried, 64) is None


def _toolkit(root: Path, files: list[str]) -> Path:
    for name in ["bin/nvcc", *files]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def test_the_jit_environment_adds_nothing_for_a_full_toolkit(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    files = ["include/cuda_runtime.h", "include/curand_kernel.h", "lib64/libcudart.so", "lib64/stubs/libcuda.so"]
    home = _toolkit(tmp_path / "cuda", files)
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert flashinfer_jit.cuda_home() == str(home)
    monkeypatch.setenv("CUDA_HOME", str(_toolkit(tmp_path / "nvcc-only", [])))  # no headers: not a toolkit
    assert flashinfer_jit.cuda_home() != str(tmp_path / "nvcc-only")
    env = flashinfer_jit.environment(str(home), tmp_path / "pkg" / "flashinfer", str(tmp_path / "ws"))
    assert env["FLASHINFER_CUDA_ARCH_LIST"] == "9.0" and env["CUDA_HOME"] == str(home)
    assert "FLASHINFER_EXTRA_CUDAFLAGS" not in env and "FLASHINFER_EXTRA_LDFLAGS" not in env


def test_the_jit_environment_finds_curand_headers_and_link_libraries_a_bare_toolkit_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    site = _toolkit(tmp_path / "site-packages", ["nvidia/curand/include/curand_kernel.h"])
    monkeypatch.setattr(sys, "path", [str(site)])
    libs = ["targets/x86_64-linux/lib/libcudart.so.13", "targets/x86_64-linux/lib/stubs/libcuda.so"]
    home = _toolkit(tmp_path / "cuda", libs)
    env = flashinfer_jit.environment(str(home), tmp_path / "pkg" / "flashinfer", str(tmp_path / "ws"))
    assert env["FLASHINFER_EXTRA_CUDAFLAGS"] == f"-isystem {site / 'nvidia/curand/include'}"
    links = tmp_path / "ws" / "link"
    assert env["FLASHINFER_EXTRA_LDFLAGS"] == f"-L{links}"
    linked = [(links / lib).resolve() for lib in ("libcudart.so", "libcuda.so")]
    assert linked == [(home / lib).resolve() for lib in libs]
    monkeypatch.setattr(sys, "path", [])  # no nvidia-curand: the headers carried beside the package
    env = flashinfer_jit.environment(str(home), tmp_path / "pkg" / "flashinfer", str(tmp_path / "ws"))
    assert env["FLASHINFER_EXTRA_CUDAFLAGS"] == f"-isystem {tmp_path / 'pkg' / 'extra_include'}"


def test_the_kernel_benchmark_without_flashinfer_records_it_unavailable_and_goes_on_to_the_other_peers(tmp_path):
    out = tmp_path / "k.json"
    args = ["bench/kernel_bench.py", "--small", "--cases", "b1-l200", "--budget-s", "20", "--flex-budget-s", "5"]
    proc = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["flashinfer"] == {"available": False, "why": "no CUDA device (the cases are on the CPU)"}
    (case,) = report["cases"]
    why = report["flashinfer"]["why"]
    assert case["peers"]["flashinfer"] is None
    assert case["peer_candidates"]["flashinfer"] == [{"refused": f"RuntimeError: unavailable: {why}"}]
    assert case["batchkv_us"] > 0  # and the run went on to the other peers (timed, or cut by the wall-clock budget)
    assert all(case["peer_candidates"][peer] for peer in ("sdpa_exact", "sdpa_padded_mask", "varlen", "flex"))
