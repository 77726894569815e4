"""The transformers parts of bench/decode.py, on a Qwen3ForCausalLM of the same shape (random bf16).

- hf_cb_calibrate: every continuous-batching setting (bench/lib/hf_cb.py) on the first few requests,
  outputs capped, within `--hf-calibrate-s`; the fastest is kept.
- hf_cb_offline: that setting on the longest prefix of the request list it can finish in
  `--hf-box-s` (from its calibrated rate; at least 8 requests), all submitted at once, at most 64 in
  flight. When no setting runs at all, the fallback: `generate` with a StaticCache, compiled, over
  batches of 64 (bench/lib/hf_baselines.py), and the reason.
- hf_cb_online: the same requests and arrivals as each batchkv online rate, each time-boxed
  (`--hf-online-box-s`); past the box the peer did not keep up, and the record says how far it got.
- batchkv_on_hf_prefix: batchkv on the peer's offline prefix (a warm-up pass, then the timed one).
- b1_hf_eager, b1_hf_static_compile: one sequence, DynamicCache eager and StaticCache + compile.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import hf_cb
from .hf_baselines import decode_ms_per_token, qwen3_like, static_compiled_batches
from .online import poisson_arrivals


def hf_parts(parts, ctx: SimpleNamespace, args) -> None:
    r, dev = parts.result, ctx.device
    s = r.setdefault("serve", {})
    prompts, outputs = ctx.prompts, ctx.outputs
    built: dict = {}

    def hf():
        if "hf" not in built:
            built["hf"] = qwen3_like(dev, tiny=ctx.small)
        return built["hf"]

    n_cal, cap = (4, 8) if ctx.small else (8, 32)

    def calibrate():
        best, tried = hf_cb.calibrate(hf(), prompts[:n_cal], outputs[:n_cal], budget_s=args.hf_calibrate_s, cap=cap)
        s["hf_cb_calibration"] = {"requests": n_cal, "output_cap": cap, "tried": tried, "best": best}
        import transformers

        r["transformers"] = transformers.__version__

    def calibrate_rest():
        """A resumed run: the candidates the calibration skipped (or has not seen) are tried now; a new
        fastest setting makes the peer's offline and online parts run again with it."""
        cal = s["hf_cb_calibration"]
        ran = [t for t in cal["tried"] if "skipped" not in t]
        rest = [c for c in hf_cb.candidates() if all(t["setting"] != c for t in ran)]
        if not rest:
            return
        _, tried = hf_cb.calibrate(hf(), prompts[:n_cal], outputs[:n_cal], args.hf_calibrate_s, cap, settings=rest)
        cal["tried"] = ran + tried
        best = hf_cb.fastest(cal["tried"])
        if best != cal.get("best"):
            cal["best"] = best
            for name in ("hf_cb_offline", "hf_cb_online", "batchkv_on_hf_prefix"):
                parts.status.pop(name, None)
            for row in s.get("online", []):
                row.pop("peer", None)

    def offline():
        calibration = s.get("hf_cb_calibration", {})
        best = calibration.get("best")
        if best is None:
            why = "no continuous-batching setting ran: " + "; ".join(
                str(t.get("failed") or t.get("skipped")) for t in calibration.get("tried", [])
            )
            run = static_compiled_batches(hf(), prompts, outputs, batch=64, box_s=args.hf_box_s)
            s["hf_fallback"] = {"name": "transformers generate, StaticCache + compile, left-padded batches of 64",
                                "tokens_per_s": run["tokens_per_s"], "why": why, **run}  # fmt: skip
            return
        rate = max(t["tokens_per_s"] for t in calibration["tried"] if t.get("setting") == best)
        n = hf_cb.prefix_fitting(outputs, rate, args.hf_box_s, least=min(8, len(outputs)))
        run = hf_cb.serve(hf(), best, prompts[:n], outputs[:n], max_inflight=64, box_s=args.hf_box_s)
        s["hf_cb_tokens_per_s"] = run["tokens_per_s"]
        note = (f"the first {n} of the {len(prompts)} requests (sized from the calibrated rate {rate:.0f} tok/s "
                f"to finish in {args.hf_box_s:.0f} s), all submitted at once")  # fmt: skip
        s["hf_cb"] = {"setting": best, "requests_measured": n, "concurrency": min(n, 64), **run, "note": note}
        print(f"serve hf_cb {best}: {run['tokens_per_s']:.0f} tok/s over {n} requests", flush=True)

    def online():
        best = s.get("hf_cb_calibration", {}).get("best")
        if best is None:
            raise RuntimeError("no continuous-batching setting to run online (see hf_cb_calibration)")
        for row in s.get("online", []):
            if row.get("peer"):
                continue
            n = row["requests"]
            arrivals = poisson_arrivals(n, row["rate"], seed=row["arrival_seed"])
            peer = hf_cb.serve(hf(), best, prompts[:n], outputs[:n], arrivals, box_s=args.hf_online_box_s)
            row["peer"] = {"name": "transformers continuous batching", "setting": best,
                           "kept_up": not peer["boxed"], **peer}  # fmt: skip
            parts.save()
            print(f"online hf_cb {row['label']}: {peer['tokens_per_s']:.0f} tok/s, finished {peer['finished']}/{n}")

    def prefix_batchkv():
        n = s["hf_cb"]["requests_measured"]
        ctx.serve_batchkv(prompts[:n], outputs[:n])  # warm-up: captures every width this prefix uses
        s["batchkv_on_hf_prefix_tokens_per_s"] = ctx.serve_batchkv(prompts[:n], outputs[:n])["output_tokens_per_s_wall"]

    def single(static: bool):
        key = "hf_static_compile_ms" if static else "hf_eager_ms"
        b1 = r.setdefault("b1", {"prompt": ctx.prompt_len, "new_tokens": ctx.new_tokens})
        hf().set_attn_implementation("sdpa")  # whatever the serving calibration left set
        b1[key] = decode_ms_per_token(hf(), ctx.prompt_len, ctx.new_tokens, static_compile=static)
        print(f"b1 {key}: {b1[key]:.3f} ms/token", flush=True)

    parts.run("hf_cb_calibrate", calibrate, need_s=30)
    if args.resume:
        parts.status.pop("hf_cb_calibrate_rest", None)
        parts.run("hf_cb_calibrate_rest", calibrate_rest, need_s=30)
    parts.run("hf_cb_offline", offline, need_s=min(args.hf_box_s, 30))
    parts.run("hf_cb_online", online, need_s=3 * args.hf_online_box_s)
    if s.get("hf_cb"):
        parts.run("batchkv_on_hf_prefix", prefix_batchkv, need_s=30)
    parts.run("b1_hf_eager", lambda: single(False), need_s=40)
    if dev.type == "cuda":  # on CPU inductor's C++ compile of the model takes minutes: not a smoke test
        parts.run("b1_hf_static_compile", lambda: single(True), need_s=150)
    built.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
