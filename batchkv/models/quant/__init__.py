"""Quantised compute: FP8 (e4m3) linear layers that a model holds in place of its float ones.

A quantised layer is a layer: `Fp8Linear` holds the e4m3 weight, its scales and the activation
quantiser, and a model is quantised by replacing its decoder's projections with it at load
(`quantize_layers`), so no model branches on the number format. `batchkv.models.quant.fp8` has
the arithmetic (and its exact CPU emulation); `batchkv.models.quant.checkpoints` reads FP8
checkpoints as their publishers ship them.
"""

from batchkv.models.quant.fp8 import (
    E4M3_MAX,
    QUANTIZATIONS,
    Fp8Linear,
    check_quantization,
    fp8_matmul,
    fp8_matmul_emulated,
    quantize_layers,
    quantize_rows,
    quantize_weight,
)

__all__ = [
    "E4M3_MAX",
    "QUANTIZATIONS",
    "Fp8Linear",
    "check_quantization",
    "fp8_matmul",
    "fp8_matmul_emulated",
    "quantize_layers",
    "quantize_rows",
    "quantize_weight",
]
