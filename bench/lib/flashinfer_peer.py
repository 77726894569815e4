"""FlashInfer as a peer of sdpa_varlen: its paged decode and prefill wrappers, every page size and backend.

FlashInfer (built by bench/lib/flashinfer_jit.py) reads K/V from a paged cache, NHD: `kv` [pages,
2, page, Hkv, D], and for sequence b the pages `indices[indptr[b]:indptr[b + 1]]` in order, all full
but the last (`last_page_len[b]` positions). `paged_kv` builds it from a case's column store outside
timing, one per rotation, each sequence's pages contiguous (the layout most favourable to a paged
cache). The page table is the same for every rotation, so one `plan` (host, not capturable) serves
every call; every wrapper is built with `use_cuda_graph=True` and timed by graph replay, as batchkv
is. Candidates (`_variants`; bench/results/README.md "Method"), page size 16 (vLLM's default) first
so that a spent budget still leaves it timed, then 32, 64 and one page per sequence; prefill and
verify cases causal (FlashInfer aligns the diagonal bottom-right, as the reference does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch

from .kernel_cases import Case
from .kernel_peers import Candidate

PAGE_SIZES = (16, 32, 64, 0)  # 0: one page per sequence
WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partials); it recommends 128 MiB


@dataclass(frozen=True)
class PageTable:
    """FlashInfer's index of a paged cache for one batch (int32 tensors, on one device)."""

    page: int  # positions per page
    indptr: torch.Tensor  # [B + 1]: sequence b's pages are indices[indptr[b]:indptr[b + 1]]
    indices: torch.Tensor  # [pages]
    last_page_len: torch.Tensor  # [B], in 1..page
    qo_indptr: torch.Tensor  # [B + 1]: sequence b's queries are rows qo_indptr[b]:qo_indptr[b + 1] of q

    def to(self, device: torch.device | str) -> PageTable:
        return PageTable(self.page, *(t.to(device) for t in (self.indptr, self.indices, self.last_page_len,
                                                             self.qo_indptr)))  # fmt: skip


def page_size(lengths: list[int], size: int) -> int:
    """`size` positions, or for 0 one page per sequence: the longest rounded up to 16 positions."""
    return size or -(-max(lengths) // 16) * 16


def page_table(lengths: list[int], q_len: int, page: int) -> PageTable:
    """Each sequence's ceil(kv_end / page) pages, contiguous and in batch order (on the CPU)."""
    counts = [-(-n // page) for n in lengths]
    indptr = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
    last = torch.tensor([n - (c - 1) * page for n, c in zip(lengths, counts, strict=True)], dtype=torch.int32)
    qo_indptr = torch.arange(0, len(lengths) * q_len + 1, q_len, dtype=torch.int32)
    return PageTable(page, indptr, torch.arange(int(indptr[-1]), dtype=torch.int32), last, qo_indptr)


def paged_kv(k: torch.Tensor, v: torch.Tensor, cols: list[int], lengths: list[int], table: PageTable) -> torch.Tensor:
    """[pages, 2, page, Hkv, D] on the store's device: sequence b (column cols[b] of the [R, C, Hkv, D] stores,
    its first lengths[b] positions) in its pages, zeros past its end."""
    _, _, hkv, d = k.shape
    kv = torch.zeros(len(table.indices), 2, table.page, hkv, d, dtype=k.dtype, device=k.device)
    for b, (col, n) in enumerate(zip(cols, lengths, strict=True)):
        pages = table.indices[table.indptr[b] : table.indptr[b + 1]].to(k.device, torch.long)
        for plane, store in enumerate((k, v)):
            seq = torch.zeros(len(pages) * table.page, hkv, d, dtype=k.dtype, device=k.device)
            seq[:n] = store[:n, col]
            kv[pages, plane] = seq.view(len(pages), table.page, hkv, d)
    return kv


def _candidate(config: dict, make: Callable[[], object], case: Case, data: list, out: torch.Tensor) -> Candidate:
    """A wrapper made (and planned) by `make` at the first call, so that one that refuses is recorded as
    refused and the next candidate still runs; call j runs on rotation j's K/V, the output is rotation 0's."""
    made: list = []

    def run(kv: torch.Tensor) -> torch.Tensor:
        if not made:
            made.append(make())
            if "asked" in config:  # the prefill backend, "auto" resolved at plan
                config["backend"] = str(getattr(made[0], "_backend", config["asked"]))
        return made[0].run(case.q, kv, out=out)

    calls = [lambda j=j: run(data[j % case.rot]) for j in range(case.calls)]
    return Candidate(config, calls, lambda: run(data[0]))


def _decode(fi: ModuleType, workspace: torch.Tensor, table: PageTable, case: Case, tensor_cores: bool):
    geo = case.geo
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=torch.empty_like(table.indptr), paged_kv_indices_buffer=torch.empty_like(table.indices),
        paged_kv_last_page_len_buffer=torch.empty_like(table.last_page_len),
    )  # fmt: skip
    wrapper.plan(table.indptr, table.indices, table.last_page_len, geo.hq, geo.hkv, geo.d, table.page,
                 pos_encoding_mode="NONE", q_data_type=geo.dtype, kv_data_type=geo.dtype)  # fmt: skip
    return wrapper


def _prefill(fi: ModuleType, workspace: torch.Tensor, table: PageTable, case: Case, asked: str, uniform: bool):
    geo = case.geo
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, backend=asked, qo_indptr_buf=torch.empty_like(table.qo_indptr),
        paged_kv_indptr_buf=torch.empty_like(table.indptr), paged_kv_indices_buf=torch.empty_like(table.indices),
        paged_kv_last_page_len_buf=torch.empty_like(table.last_page_len),
    )  # fmt: skip
    wrapper.plan(table.qo_indptr, table.indptr, table.indices, table.last_page_len, geo.hq, geo.hkv, geo.d,
                 table.page, causal=True, pos_encoding_mode="NONE", q_data_type=geo.dtype, kv_data_type=geo.dtype,
                 uniform_q_len=case.q_len if uniform else None)  # fmt: skip
    return wrapper


def _variants(case: Case, hopper: bool) -> list[dict]:
    """The wrapper settings tried at each page size, in order."""
    if case.q_len == 1:
        return [{"api": "BatchDecodeWithPagedKVCacheWrapper", "tensor_cores": tc} for tc in (False, True)]
    prefill = "BatchPrefillWithPagedKVCacheWrapper"
    asked = ("auto", "fa3", "fa2") if hopper else ("auto", "fa2")  # FA3 is sm_90's
    runs = [{"api": prefill, "asked": b, "uniform_q_len": False} for b in asked]
    if case.q_len <= 64:  # FA2's tile sized for q_len * G rows, not the ragged worst case (verify blocks)
        runs.append({"api": prefill, "asked": "fa2", "uniform_q_len": True})
    return runs


def flashinfer(fi: ModuleType | None, info: dict, case: Case, k: torch.Tensor, v: torch.Tensor) -> Iterator[Candidate]:
    """Every FlashInfer variant on `case` (module docstring); raises at once when `fi` is None (why: info)."""
    if fi is None:
        raise RuntimeError(f"unavailable: {info.get('why')}")
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=k.device)  # wrappers run one at a time
    out = torch.empty_like(case.q)  # [T, Hq, D]
    for size in PAGE_SIZES:
        table = page_table(case.lengths, case.q_len, page_size(case.lengths, size)).to(k.device)
        data = [paged_kv(k, v, cols, case.lengths, table) for cols in case.cols]
        picked = None  # what "auto" resolved to: not asked for again
        for variant in _variants(case, torch.cuda.get_device_capability() == (9, 0)):
            if "asked" in variant and variant["asked"] == picked and not variant["uniform_q_len"]:
                continue
            config = {**variant, "page_size": table.page, "pages": "one per sequence" if size == 0 else "contiguous"}
            if "tensor_cores" in variant:
                make = partial(_decode, fi, workspace, table, case, variant["tensor_cores"])
            else:
                make = partial(_prefill, fi, workspace, table, case, variant["asked"], variant["uniform_q_len"])
            yield _candidate(config, make, case, data, out)
            picked = config.get("backend") if variant.get("asked") == "auto" else picked
        del data
    if case.batch == 1 and case.q_len == 1:
        n = case.lengths[0]
        seqs = [(k[:n, cols[0]].contiguous(), v[:n, cols[0]].contiguous()) for cols in case.cols]  # [L, Hkv, D]

        def single(j: int) -> torch.Tensor:
            return fi.single_decode_with_kv_cache(case.q[0], *seqs[j % case.rot], kv_layout="NHD")[None]

        config = {"api": "single_decode_with_kv_cache", "pages": "none: contiguous [L, Hkv, D]"}
        yield Candidate(config, [partial(single, j) for j in range(case.calls)], partial(single, 0))


def at_page(tried: list[dict], page: int) -> float | None:
    """The fastest timed candidate's µs at `page` positions per page, from a case's peer_candidates."""
    times = [r["us"] for r in tried if "us" in r and r.get("config", {}).get("page_size") == page]
    return min(times, default=None)
