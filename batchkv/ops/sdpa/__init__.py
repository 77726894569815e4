"""`sdpa_varlen` in Triton: the host side and the device code of the attention kernel.

- `launch`: `sdpa_varlen(...)`, the function the cache calls (picks a variant, sizes the grid,
  launches); `batchkv.ops.sdpa_varlen` is the same function, imported lazily.
- `checks`: the refusals of `sdpa_varlen`'s arguments (`ContractError`s raised before any launch).
- `config`: `SdpaConfig`, `DEFAULT_CONFIG` and the static heuristic that resolves a config per call.
- Device code: `kernels` (the stream-K kernel for decode and short chunks), `long` (prompt chunks),
  `splitkv` (the two-launch split-KV variant), and their parts `attend` (one head's tile loop),
  `warp_split` (keys cut across warps), `merge` (partials merged by the last program) and `common`
  (helpers shared by all of them).

Nothing is imported here, so importing a submodule (the config, say) does not pull in the others.
"""
