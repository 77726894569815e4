"""Tensor parallelism: TP=1 and TP=2 in the same call, on two GPUs of one host (nvidia-h200-x2).

Parts, in order, each written to the JSON as it ends (`--resume` runs only the missing ones):
1. ceilings: copy and read bandwidth of GPU 0, and all-reduce bus bandwidth between the ranks (NCCL,
   two processes of their own, graphs of back-to-back collectives; busbw = bytes * 2 (N - 1) / N /
   time); one decode row's all-reduce and the logits all-gather give the collectives per step;
2. b1: bench/decode.py's one sequence on the SenseNova-U1-8B shape at TP=1 and TP=2, against the
   weight+KV read roofline at 1 and 2 GPUs, and the greedy tokens of both (bf16 may part at a near
   tie: the first divergence is reported);
3. greedy_fp32: the same shape in fp32, prompt 128, 32 tokens: TP=2 tokens against TP=1's;
4. serve: bench/decode.py's standard serving workload, output tokens/s at TP=1 and TP=2;
5. llama70b: a Llama-3-70B-shaped model (~141 GB of random bf16 weights; SenseNovaLM at that
   geometry reads the same bytes) at TP=2: serving tok/s, then on the same engine one-sequence
   ms/token against its weight-read roofline at two GPUs' bandwidth.

Every process batchkv starts keeps NVLink multicast off (batchkv.tp.group.NO_MULTICAST).

    python3 bench/tp.py --out bench/results/tp-h200x2.json          # on nvidia-h200-x2
    python bench/tp.py --small --out /tmp/tp.json                    # CPU smoke run, TP=2 over gloo
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchkv.models import SenseNovaConfig, preset_config
from batchkv.models.loading import load
from batchkv.tp.group import no_multicast
from bench.lib.ceilings import copy_ceiling, read_ceiling
from bench.lib.serving import Parts, one_sequence, release, serve_offline, serving_engine, single, warm_up, workload
from bench.lib.timing import Deadline, capture, median_us

LLAMA_70B = SenseNovaConfig(num_layers=80, hidden=8192, q_heads=64, kv_heads=8, head_dim=128, intermediate=28672,
                            vocab=128256, dtype=torch.bfloat16)  # fmt: skip
GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch 2.6 has only the latter)
SMALL_70B = SenseNovaConfig(num_layers=2, hidden=128, q_heads=8, kv_heads=2, head_dim=16, intermediate=256,
                            vocab=1000, dtype=torch.float32, lm_head_gain=8.0)  # fmt: skip


# ---- collectives, measured in two processes of their own ---------------------------------------
def _collective_rank(rank: int, world: int, port: int, sizes: list[int], gathers: list[int], queue) -> None:
    """One rank of the collective measurement (rank 0 is the bench's own process, then left clean)."""
    no_multicast()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(minutes=5))  # fmt: skip
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                            **({"device_id": device} if cuda else {}))  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    out: dict[str, dict] = {"all_reduce": {}, "all_gather": {}}
    for kind, nbytes in [("all_reduce", n) for n in sizes] + [("all_gather", n) for n in gathers]:
        x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype, device=device)
        y = torch.empty(world * x.numel(), dtype=dtype, device=device)
        op = functools.partial(dist.all_reduce, x) if kind == "all_reduce" else functools.partial(GATHER, y, x)
        us = _time_collective(op, cuda)
        bus = nbytes * (2 if kind == "all_reduce" else 1) * (world - 1) / world / (us * 1e-6) / 1e9
        out[kind][str(nbytes)] = {"us": round(us, 2), "busbw_gbps": round(bus, 2)}
    dist.destroy_process_group()
    if queue is not None:
        queue.put(out)


def _time_collective(op, cuda: bool, calls: int = 20, replays: int = 10) -> float:
    """µs per call: a CUDA graph of `calls` back-to-back collectives, median replay; CPU: wall clock."""
    for _ in range(3):
        op()
    if not cuda:
        start = time.perf_counter()
        for _ in range(calls):
            op()
        return (time.perf_counter() - start) / calls * 1e6
    graph = capture(lambda: [op() for _ in range(calls)], error_mode="thread_local")
    return median_us(graph.replay, replays) / calls


def collectives(world: int, sizes: list[int], gathers: list[int]) -> dict:
    """Collective times and bus bandwidth: this process is rank 0 (its process group is destroyed
    after, so the engines can start theirs), the others are spawned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = torch.multiprocessing.get_context("spawn")
    procs = [context.Process(target=_collective_rank, args=(r, world, port, sizes, gathers, None))
             for r in range(1, world)]  # fmt: skip
    for p in procs:
        p.start()
    results: list[dict] = []
    _collective_rank(0, world, port, sizes, gathers, SimpleNamespace(put=results.append))
    for p in procs:
        p.join(600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"the collective ranks exited with {[p.exitcode for p in procs]}")
    return results[0]


# ---- engine runs ---------------------------------------------------------------------------------
def serving(source, tp: int, device, prompts, outputs, then=None) -> dict:
    """The standard serving run (bench/decode.py's configuration), warmed up first: output tok/s;
    `then(engine)`, if given, runs on the idle engine after it (its result under "then")."""
    with serving_engine(source, device, prompts, outputs, tensor_parallel=tp) as engine:
        warm_up(engine, device, prompts, outputs)
        d = serve_offline(engine, device, prompts, outputs)
        store = engine.sizing.describe() if engine.sizing else None
        after = then(engine) if then is not None else None
    release(device)
    return {"tokens_per_s": d["output_tokens_per_s_wall"], "wall_s": d["wall_s"], "itl_ms_p50": d["itl_ms_p50"],
            "itl_ms_p99": d["itl_ms_p99"], "ttft_ms_p50": d["ttft_ms_p50"], "store": store, "then": after}  # fmt: skip


def agreement(a: list[int], b: list[int]) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return {"equal": a == b, "first_divergence": first, "tokens": len(a)}


def roofline_ms(cfg: SenseNovaConfig, positions: int, gpus: int, read_gbps: float) -> float:
    """Weights and the mean K/V read once per token, split over `gpus` at `read_gbps` each."""
    item = torch.empty((), dtype=cfg.dtype).element_size()
    kv = cfg.num_layers * 2 * cfg.kv_heads * cfg.head_dim * item * positions
    return (cfg.num_params * item + kv) / gpus / (read_gbps * 1e9) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/tp-h200x2.json"))
    ap.add_argument("--small", action="store_true", help="tiny models and workload, TP=2 over gloo: a smoke run")
    ap.add_argument("--budget-s", type=float, default=3000.0, help="wall-clock budget of the whole run")
    ap.add_argument("--resume", type=Path, default=None, help="a result JSON to complete: only missing parts run")
    args = ap.parse_args()
    small, cuda = args.small, torch.cuda.is_available() and not args.small
    device = torch.device("cuda" if cuda else "cpu")
    if not small and (not cuda or torch.cuda.device_count() < 2):
        ap.error("the full run needs two GPUs (nvidia-h200-x2); on a CPU use --small")
    if not cuda:
        torch.set_num_threads(1)
    base = preset_config("sensenova-u1-tiny" if small else "sensenova-u1-8b")
    big = SMALL_70B if small else LLAMA_70B
    prompt_len, new_tokens = (32, 16) if small else (512, 256)
    n, prompt_range, output_range = (8, (8, 48), (4, 24)) if small else (256, (64, 2048), (64, 1024))
    prompts, outputs = workload(n, prompt_range, output_range, base.vocab, seed=0)
    big_prompts, big_outputs = workload(n, prompt_range, output_range, big.vocab, seed=0)
    result = json.loads(args.resume.read_text()) if args.resume else {}
    result.update(device=torch.cuda.get_device_name() if cuda else "cpu (gloo smoke run)", torch=torch.__version__,
                  small=small, model_8b=str(base), model_70b=str(big))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    parts, r = Parts(result, args.out, Deadline(args.budget_s)), result
    source = functools.partial(load, base, seed=0)
    mean_pos = prompt_len + new_tokens // 2

    def ceilings():
        r["copy_gbps"], r["copy_variants_gbps"] = copy_ceiling(device)
        r["read_gbps"], r["read_variants_gbps"] = read_ceiling(device)
        hidden = [base.hidden * 2, big.hidden * 2, 64 * base.hidden * 2]  # a decode row (8B, 70B), 64 rows
        sizes = [*hidden, 2**20, 64 * 2**20, 256 * 2**20] if cuda else [*hidden, 2**20]
        logits = [base.vocab // 2 * 4, big.vocab // 2 * 4]  # one row's float32 logits per rank
        r["collectives"] = c = collectives(2, sizes, logits)
        r["allreduce_busbw_gbps"] = max(v["busbw_gbps"] for v in c["all_reduce"].values())
        per_step = {}
        for name, cfg in (("8b", base), ("70b", big)):
            reduce_us = c["all_reduce"][str(cfg.hidden * 2)]["us"]
            gather_us = c["all_gather"][str(cfg.vocab // 2 * 4)]["us"]
            per_step[name] = {"all_reduces": 2 * cfg.num_layers + 1, "all_reduce_us": reduce_us,
                              "logits_gather_us": gather_us,
                              "ms": ((2 * cfg.num_layers + 1) * reduce_us + gather_us) / 1e3}  # fmt: skip
        r["allreduce_per_step_b1"] = per_step

    def b1():
        b1s = {tp: one_sequence(source, device, prompt_len, new_tokens, base.vocab, cuda, tp) for tp in (1, 2)}
        r["b1_detail"] = b1s
        one, two = r["b1_detail"][1], r["b1_detail"][2]
        r["b1"] = {"tp1_ms": one["ms_per_token_p50"], "tp2_ms": two["ms_per_token_p50"],
                   "tp2_over_tp1": two["ms_per_token_p50"] / one["ms_per_token_p50"], "target_tp2_over_tp1": 0.6,
                   "roofline_tp1_ms": roofline_ms(base, mean_pos, 1, r["read_gbps"]),
                   "roofline_tp2_ms": roofline_ms(base, mean_pos, 2, r["read_gbps"]),
                   "greedy_bf16": agreement(one.pop("tokens"), two.pop("tokens"))}  # fmt: skip
        print(f"b1: {r['b1']}", flush=True)

    def greedy_fp32():
        fp32 = functools.partial(load, base, seed=0, dtype=torch.float32)
        runs = [one_sequence(fp32, device, min(prompt_len, 128), 32, base.vocab, cuda, tp)["tokens"] for tp in (1, 2)]
        r["greedy_fp32"] = agreement(*runs)
        print(f"greedy fp32: {r['greedy_fp32']}", flush=True)

    def serve():
        r["serve_detail"] = {tp: serving(source, tp, device, prompts, outputs) for tp in (1, 2)}
        one, two = (r["serve_detail"][tp]["tokens_per_s"] for tp in (1, 2))
        r["serve"] = {"tp1_tokens_per_s": one, "tp2_tokens_per_s": two, "tp2_over_tp1": two / one,
                      "target_tp2_over_tp1": 1.7, "requests": n}  # fmt: skip
        print(f"serve: {r['serve']}", flush=True)

    def llama70b():  # one engine (its weights drawn once): serving, then one sequence on it
        big_source = functools.partial(load, big, seed=0)
        b1_run = functools.partial(single, device=device, prompt_len=prompt_len, new_tokens=new_tokens // 2,
                                   vocab=big.vocab)  # fmt: skip
        served = serving(big_source, 2, device, big_prompts, big_outputs, then=b1_run)
        b1_run = served.pop("then")
        b1_run.pop("tokens")
        r["llama70b"] = {"tp2_ms": b1_run["ms_per_token_p50"], "b1_detail": b1_run,
                         "roofline_ms": roofline_ms(big, prompt_len + new_tokens // 4, 2, r["read_gbps"]),
                         "tp2_tokens_per_s": served["tokens_per_s"],
                         "weight_gb": big.num_params * big.dtype.itemsize / 1e9, "serve_detail": served}  # fmt: skip
        print(f"llama70b: {r['llama70b']}", flush=True)

    parts.run("ceilings", ceilings)
    parts.run("b1", b1, need_s=60)
    if not small:  # the tiny model is fp32 already: b1's comparison is this one
        parts.run("greedy_fp32", greedy_fp32, need_s=120)
    parts.run("serve", serve, need_s=120)
    parts.run("llama70b", llama70b, need_s=300)


if __name__ == "__main__":
    main()
