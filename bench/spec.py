"""Speculative decoding at SenseNova-U1-8B shape, CONTROLLED ACCEPTANCE: tokens/s beside plain graph
decode in the same run, and the step-time split (draft, verify, host).

A trained drafter's acceptance cannot be measured without its weights, so this measures the
mechanism. Target: SenseNova-U1-8B shape, random bf16 weights. Drafter: DFlash, 5 layers of the
target's width, block 16, random bf16 weights. A bench-only proposer runs the drafter (its cost
counts), then replaces its drafts with the target's own greedy continuation (recorded by the plain
run of the same requests) with draft tau wrong, so each verify segment accepts tau - 1 drafts and
emits tau tokens: controlled acceptance tau in {1, 2, 4, 7}. Where batching numerics make the target
leave the recorded continuation, fewer drafts are accepted; the JSON reports the measured mean.

Cells: plain graph decode and each tau at 1, 8 and 32 sequences (prompt 32, --new-tokens each,
greedy); every cell warms up (captures) once, then is timed. JSON is written after each cell
(--out), and cells are skipped once --budget-s has passed, so the run fits its slot. On the H200:
    python3 bench/spec.py --out bench/results/spec-h200.json            (about 4 minutes)
CPU smoke test:
    python bench/spec.py --preset sensenova-u1-tiny --device cpu --new-tokens 12 --batches 1,4 --taus 1,4 \
        --out /tmp/spec.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.models import build_model
from batchkv.models.dflash import build_drafter, default_target_layers

LABEL = "controlled acceptance: drafts are the target's own greedy continuation with draft tau wrong"


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
    drafter's graph: no host synchronisation is added.
    """
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sensenova-u1-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batches", default="1,8,32", help="sequences per cell, comma-separated")
    ap.add_argument("--taus", default="1,2,4,7", help="controlled acceptance lengths, comma-separated")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip the cells left after this long")
    ap.add_argument("--out", default="bench/results/spec-h200.json")
    args = ap.parse_args()
    batches, taus = [int(x) for x in args.batches.split(",")], [int(x) for x in args.taus.split(",")]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = build_model(args.preset, device, seed=0)
    taps = default_target_layers(model.config.num_layers)
    drafter = build_drafter(model, num_layers=args.draft_layers, target_layer_ids=taps, block_size=args.block, seed=1)
    opts = {"max_seqs": max(batches), "capacity": 32 + args.new_tokens + args.block, "max_step_tokens": 32 * 32,
            "prefill_chunk": 32}  # fmt: skip
    plain = Engine(model, **opts)
    spec = Engine(model, speculative=SpeculativeConfig("dflash", block_size=args.block, drafter=drafter), **opts)
    verify_t = Timer(spec.runner, device)
    draft_t = Timer(spec.speculator.proposer.runner, device)
    proposer = spec.speculator.proposer
    result: dict = {"label": LABEL, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "preset": args.preset, "draft_layers": args.draft_layers, "block_size": args.block,
                    "target_layer_ids": list(taps), "prompt_tokens": 32, "new_tokens": args.new_tokens,
                    "graphs": plain.uses_graphs, "plain": {}, "spec": [], "split_ms": {}}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    known: dict[int, dict] = {}
    for b in batches:
        reqs = requests(b, model.vocab_size, args.new_tokens)
        serve(plain, reqs)  # warm-up: captures
        tokens, wall, steps = serve(plain, reqs)
        known[b] = {(r.prompt_ids, 0): t for r, t in zip(reqs, tokens, strict=True)}
        result["plain"][f"b{b}"] = sum(map(len, tokens)) / wall
        print(f"plain b{b}: {result['plain'][f'b{b}']:.1f} tok/s ({1e3 * wall / steps:.2f} ms/step)", flush=True)
        write()
    for tau in taus:
        row: dict = {"tau": tau}
        for b in batches:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent: tau {tau} b{b} skipped", flush=True)
                continue
            proposer.__dict__.pop("propose", None)  # the drafter's own, then this cell's control
            control(proposer, known[b], tau)
            reqs = requests(b, model.vocab_size, args.new_tokens)
            serve(spec, reqs)  # warm-up: captures
            m = spec.metrics
            before = (m.spec_segments, m.spec_accepted, verify_t.collect(), draft_t.collect(), m.steps)
            tokens, wall, steps = serve(spec, reqs)
            segments, accepted = m.spec_segments - before[0], m.spec_accepted - before[1]
            verify_ms, draft_ms = verify_t.collect() - before[2], draft_t.collect() - before[3]
            row[f"b{b}"] = sum(map(len, tokens)) / wall
            by_batch = row.setdefault("accept_len_by_batch", {})
            by_batch[f"b{b}"] = (accepted + segments) / max(segments, 1)
            row["accept_len_mean"] = sum(by_batch.values()) / len(by_batch)
            split = {"step": 1e3 * wall / steps, "draft": draft_ms / steps, "verify": verify_ms / steps}
            split["host"] = split["step"] - split["draft"] - split["verify"]
            result["split_ms"][f"tau{tau}_b{b}"] = split
            speedup = row[f"b{b}"] / result["plain"][f"b{b}"]
            times = ", ".join(f"{k} {v:.2f}" for k, v in split.items())
            accept = by_batch[f"b{b}"]
            print(f"tau {tau} b{b}: {row[f'b{b}']:.1f} tok/s ({speedup:.2f}x plain), accept len {accept:.2f}, "
                  f"ms/step {times}", flush=True)  # fmt: skip
            result["spec"] = [r for r in result["spec"] if r["tau"] != tau] + [row]
            write()
    print(f"wrote {out} ({LABEL}) in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
