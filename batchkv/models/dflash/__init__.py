"""DFlash block drafter (z-lab, "Block Diffusion for Flash Speculative Decoding"): our code from the
published description, attending through a batchkv cache.

One drafter forward drafts a whole block per sequence. Per packed row (W rows, hidden H):

    ctx      = RMSNorm(fc(features)) * hidden_norm      # features: the target's hidden states after
                                                        # target_layer_ids, concatenated [W, n*H]
    h        = target.embed(input_ids)                  # block rows: [anchor, mask_token_id x k]
    for each layer:
        x        = RMSNorm(h) * input_layernorm
        src      = ctx on context rows, x on block rows # K/V of context rows come from the features
        q        = RMSNorm_head(x @ Wq.T) * q_norm ; k = RMSNorm_head(src @ Wk.T) * k_norm ; v = src @ Wv.T
        q, k     = rope(q, t), rope(k, t)               # rotate-half, base rope_theta, t = RoPE index
        h        = h + attend_non_causal(q, k, v) @ Wo.T
        x        = RMSNorm(h) * post_attention_layernorm
        h        = h + (silu(x @ Wgate.T) * (x @ Wup.T)) @ Wdown.T
    out      = RMSNorm(h[rows]) * norm                  # -> the target's LM head: drafts

On the column store each owner's rows are one non-causal segment `[new context rows..., block rows]`
over its drafter column: the block attends to every committed context position and to the whole
block. The context rows' outputs are discarded; after drafting the owner is rewound to its
committed length, so only context K/V stay. The drafter's cache: flat layers, causal off, its own
geometry (`cache_spec`), one run per owner.

Checkpoints use the published names (`fc.weight`, `hidden_norm.weight`, `norm.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.{input,post_attention}_layernorm.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`)
and a `config.json` whose `dflash_config` holds `target_layer_ids`, `block_size` and `mask_token_id`.
"""

from batchkv.models.dflash.config import DFlashConfig
from batchkv.models.dflash.model import DFlashDrafter
from batchkv.models.dflash.weights import (
    build_drafter,
    checkpoint_names,
    default_target_layers,
    load_drafter_weights,
    save_drafter,
)

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "build_drafter",
    "checkpoint_names",
    "default_target_layers",
    "load_drafter_weights",
    "save_drafter",
]
