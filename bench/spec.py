"""Speculative decoding at SenseNova-U1-8B shape, CONTROLLED ACCEPTANCE: tokens/s beside plain graph
decode in the same run, and the step-time split (draft, verify, host).

A trained drafter's acceptance cannot be measured without its weights, so this measures the
mechanism. Target: SenseNova-U1-8B shape, random bf16 weights made predictable (`predictable`).
Drafter: DFlash, 5 layers of the target's width, block 16, random bf16 weights. A bench-only
proposer runs the drafter (its cost counts), then replaces its drafts with the target's own greedy
continuation (recorded by the plain run of the same requests) with draft tau wrong, so each verify
segment accepts tau - 1 drafts and emits tau tokens: controlled acceptance tau in {1, 2, 4, 7}.
A random target's next-token distribution is nearly flat, so the bf16 rounding that differs between
a one-row decode and a 16-row verify moves the argmax and verify leaves the recorded continuation
(the 2026-11-30 run measured acceptance 1.2 whatever tau); `predictable` says how the argmax is
made robust with every weight's shape and bytes kept (`continuation_follows_succ` checks it).

The engine's draft lengths adapt to acceptance (`batchkv.executor.speculative.policy`), as served;
`--fixed-taus` cells run the same with every block at block_size - 1 (`spec_fixed`).

Cells: plain graph decode and each tau at 1, 8 and 32 sequences (prompt 32, --new-tokens each,
greedy; 85 new tokens make 84 decode tokens, a multiple of every tau, so no run ends on a short
block); with graphs every cell warms up (captures) once, then is timed. JSON is written after each cell
(--out), and cells are skipped once --budget-s has passed, so the run fits its slot. On the H200:
    python3 bench/spec.py --out bench/results/spec-h200.json            (about 3 minutes)
CPU smoke test:
    python bench/spec.py --preset sensenova-u1-tiny --device cpu --new-tokens 29 --batches 1,4 --taus 1,4 \
        --fixed-taus 1 --out /tmp/spec.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.models import SenseNovaLM, build_model
from batchkv.models.dflash import build_drafter, default_target_layers

LABEL = (
    "controlled acceptance: drafts are the target's own greedy continuation with draft tau wrong; "
    "target weights made predictable (embedding x16, LM head = embedding rows of a random cyclic "
    "successor / sqrt(H)), same shapes and bytes"
)
EMBED_SCALE = 16.0


@torch.no_grad()
def predictable(model: SenseNovaLM, seed: int = 0, scale: float = EMBED_SCALE) -> torch.Tensor:
    """Make greedy decoding of `model` follow a random successor table, robustly.

    In place: embed_tokens *= scale, so the residual stream is dominated by the current token's
    embedding (the 42 random layers add a residual of RMS ~6 to its 1 before scaling), and
    lm_head[succ[i]] = embed_tokens_before[i] / sqrt(hidden): the argmax is succ[current token] by
    ~50 logits, far above any bf16 rounding. Returns succ, int64 [vocab] on the CPU (one cycle).
    """
    vocab, hidden = model.embed_tokens.shape
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    succ = torch.empty(vocab, dtype=torch.int64)
    succ[order] = order.roll(-1)
    model.lm_head.index_copy_(0, succ.to(model.device), model.embed_tokens * hidden**-0.5)
    model.embed_tokens.mul_(scale)
    return succ


class Timer:
    """Device time of the calls of one runner's `execute` (CUDA events; host clock on the CPU)."""

    def __init__(self, runner, device: torch.device) -> None:
        self.cuda, self.pending, self.ms = device.type == "cuda", [], 0.0
        plain = runner.execute

        def execute(head, fn):
            if not self.cuda:
                start = time.perf_counter()
                out = plain(head, fn)
                self.ms += 1e3 * (time.perf_counter() - start)
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = plain(head, fn)
            end.record()
            self.pending.append((start, end))
            return out

        runner.execute = execute

    def collect(self) -> float:
        for start, end in self.pending:
            end.synchronize()
            self.ms += start.elapsed_time(end)
        self.pending = []
        return self.ms


def control(proposer, known: dict, tau: int) -> None:
    """After the drafter ran, its drafts become the known continuation with draft `tau` wrong.

    The replacement is one pinned host-to-device copy and one scatter on the stream, after the
    drafter's graph: no host synchronisation is added. Replaces any earlier control.
    """
    proposer.__dict__.pop("propose", None)
    plain = proposer.propose
    vocab = proposer.drafter.config.vocab
    size, device = proposer.drafts.numel(), proposer.drafts.device
    pin = device.type == "cuda"
    host = torch.zeros(2, size, dtype=torch.int64, pin_memory=pin)
    dev = torch.zeros(2, size, dtype=torch.int64, device=device)
    copied = torch.cuda.Event() if pin else None

    def propose(batch, samples, counts):
        drafts = plain(batch, samples, counts)
        if copied is not None:
            copied.synchronize()  # the last copy out of the pinned buffer is done
        n = 0
        for sample, src in zip(samples, drafts.src, strict=True):
            future, emitted = known.get((sample.owner.prompt, sample.index), []), len(sample.tokens)
            for j, slot in enumerate(src):
                token = future[emitted + j] if emitted + j < len(future) else 0
                host[0, n], host[1, n] = slot, (token + 1) % vocab if j == tau - 1 else token
                n += 1
        if n:
            dev[:, :n].copy_(host[:, :n], non_blocking=pin)
            if copied is not None:
                copied.record()
            proposer.drafts.index_copy_(0, dev[0, :n], dev[1, :n])
        return drafts

    proposer.propose = propose


def requests(batch: int, vocab: int, new_tokens: int) -> list[Request]:
    gen = torch.Generator().manual_seed(batch)
    return [
        Request(torch.randint(vocab, (32,), generator=gen).tolist(), SamplingParams(max_new_tokens=new_tokens))
        for _ in range(batch)
    ]


def serve(engine: Engine, reqs: list[Request]) -> tuple[list[list[int]], float, int]:
    """Run the requests; (tokens per request, wall seconds, steps)."""
    steps = engine.metrics.steps
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids = [engine.submit(r) for r in reqs]
    out = gather(engine.run_until_done())
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return [out[i].tokens[0] for i in ids], time.perf_counter() - start, engine.metrics.steps - steps


def follows(succ: torch.Tensor, reqs: list[Request], tokens: list[list[int]]) -> float:
    """Share of tokens equal to succ[previous token]."""
    hits = total = 0
    for request, out in zip(reqs, tokens, strict=True):
        prev = request.prompt_ids[-1]
        for token in out:
            hits, total, prev = hits + (int(succ[prev]) == token), total + 1, token
    return hits / max(total, 1)


def measure(args: argparse.Namespace, on_cell: Callable[[dict], None] = lambda result: None) -> dict:
    """Every cell of the run (see the module docstring); `on_cell(result)` after each one."""
    batches, taus = [int(x) for x in args.batches.split(",")], [int(x) for x in args.taus.split(",")]
    fixed_taus = [int(x) for x in args.fixed_taus.split(",") if x]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = build_model(args.preset, device, dtype=dtype, seed=0)
    succ = predictable(model) if not args.raw_target else torch.arange(model.vocab_size).roll(-1)
    taps = default_target_layers(model.config.num_layers)
    drafter = build_drafter(model, num_layers=args.draft_layers, target_layer_ids=taps, block_size=args.block, seed=1)
    opts = {"max_seqs": max(batches), "capacity": 32 + args.new_tokens + args.block, "max_step_tokens": 32 * 32,
            "prefill_chunk": 32}  # fmt: skip
    plain = Engine(model, **opts)
    result: dict = {"label": LABEL, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "preset": args.preset, "dtype": str(model.dtype).removeprefix("torch."),
                    "target": "random weights" if args.raw_target else f"predictable, embed_scale {EMBED_SCALE}",
                    "draft_layers": args.draft_layers, "block_size": args.block, "target_layer_ids": list(taps),
                    "prompt_tokens": 32, "new_tokens": args.new_tokens, "graphs": plain.uses_graphs,
                    "draft_policy": "adaptive (batchkv.executor.speculative.policy)", "plain": {},
                    "continuation_follows_succ": {}, "spec": [], "split_ms": {}, "spec_fixed": [],
                    "split_ms_fixed": {}}  # fmt: skip
    known: dict[int, dict] = {}
    for b in batches:
        reqs = requests(b, model.vocab_size, args.new_tokens)
        if plain.uses_graphs:
            serve(plain, reqs)  # warm-up: captures
        tokens, wall, steps = serve(plain, reqs)
        known[b] = {(r.prompt_ids, 0): t for r, t in zip(reqs, tokens, strict=True)}
        result["plain"][f"b{b}"] = sum(map(len, tokens)) / wall
        result["continuation_follows_succ"][f"b{b}"] = follows(succ, reqs, tokens)
        print(f"plain b{b}: {result['plain'][f'b{b}']:.1f} tok/s ({1e3 * wall / steps:.2f} ms/step), "
              f"follows succ {result['continuation_follows_succ'][f'b{b}']:.4f}", flush=True)  # fmt: skip
        on_cell(result)
    for adaptive, cells, rows_key, split_key in ((True, taus, "spec", "split_ms"),
                                                 (False, fixed_taus, "spec_fixed", "split_ms_fixed")):  # fmt: skip
        if not cells:
            continue
        config = SpeculativeConfig("dflash", block_size=args.block, drafter=drafter, adaptive=adaptive)
        spec = Engine(model, speculative=config, **opts)
        verify_t, draft_t = Timer(spec.runner, device), Timer(spec.speculator.proposer.runner, device)
        for tau in cells:
            row: dict = {"tau": tau}
            for b in batches:
                if time.perf_counter() - t0 > args.budget_s:
                    print(f"budget spent: {rows_key} tau {tau} b{b} skipped", flush=True)
                    continue
                control(spec.speculator.proposer, known[b], tau)
                reqs = requests(b, model.vocab_size, args.new_tokens)
                if spec.uses_graphs:
                    serve(spec, reqs)  # warm-up: captures
                m = spec.metrics
                before = (m.spec_segments, m.spec_accepted, m.spec_proposed, verify_t.collect(), draft_t.collect(),
                          m.steps)  # fmt: skip
                tokens, wall, steps = serve(spec, reqs)
                segments, accepted = m.spec_segments - before[0], m.spec_accepted - before[1]
                verify_ms, draft_ms = verify_t.collect() - before[3], draft_t.collect() - before[4]
                row[f"b{b}"] = sum(map(len, tokens)) / wall
                row.setdefault("accept_len_by_batch", {})[f"b{b}"] = (accepted + segments) / max(segments, 1)
                row.setdefault("drafts_per_step", {})[f"b{b}"] = (m.spec_proposed - before[2]) / (steps * b)
                row["accept_len_mean"] = sum(row["accept_len_by_batch"].values()) / len(row["accept_len_by_batch"])
                split = {"step": 1e3 * wall / steps, "draft": draft_ms / steps, "verify": verify_ms / steps}
                split["host"] = split["step"] - split["draft"] - split["verify"]
                result[split_key][f"tau{tau}_b{b}"] = split
                speedup = row[f"b{b}"] / result["plain"][f"b{b}"]
                times = ", ".join(f"{k} {v:.2f}" for k, v in split.items())
                print(f"{rows_key} tau {tau} b{b}: {row[f'b{b}']:.1f} tok/s ({speedup:.2f}x plain), accept len "
                      f"{row['accept_len_by_batch'][f'b{b}']:.2f}, ms/step {times}", flush=True)  # fmt: skip
                result[rows_key] = [r for r in result[rows_key] if r["tau"] != tau] + [row]
                on_cell(result)
    result["seconds"] = time.perf_counter() - t0
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sensenova-u1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="", help="model dtype (default: the preset's), e.g. bfloat16")
    ap.add_argument("--new-tokens", type=int, default=85)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batches", default="1,8,32", help="sequences per cell, comma-separated")
    ap.add_argument("--taus", default="7,1,4,2", help="controlled acceptance lengths, comma-separated")
    ap.add_argument("--fixed-taus", default="1,7", help="taus also run with fixed blocks (empty: none)")
    ap.add_argument("--raw-target", action="store_true", help="keep the random weights (the 2026-11-30 setup)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip the cells left after this long")
    ap.add_argument("--out", default="bench/results/spec-h200.json")
    return ap


def main() -> None:
    args = parser().parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = measure(args, lambda r: out.write_text(json.dumps(r, indent=2) + "\n"))
    out.write_text(json.dumps(result, indent=2) + "\n")
    taus_ok = all(math.isclose(r["accept_len_mean"], r["tau"], rel_tol=0.05) for r in result["spec"])
    print(f"wrote {out} in {result['seconds']:.0f} s; accept len within 5% of every tau: {taus_ok}")


if __name__ == "__main__":
    main()
