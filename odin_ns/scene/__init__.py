"""Scene state of Odin: blocks, read sets, ownership, shards and the selective Adam that updates them.

Every module here is local and deterministic (no torch.distributed): the runtime composes them. Among them:

- `morton`: Morton (Z-order) codes of quantized positions.
- `blocks`: `BlockLayout`, runs of Morton order cut into blocks, with per-block bounds.
- `read_sets`: which blocks a camera may see (conservative against gsplat's projection).
- `ownership`: which rank owns which block (balanced, local, cheap to rebalance).
- `gather`: per-owner shards of per-Gaussian tensors and their bit-exact reassembly.
- `selective_adam`: visibility-masked Adam (gsplat's `SelectiveAdam` update, runnable on CPU).
- `optimizer_config`: the nerfstudio `OptimizerConfig` that builds it (kept apart: it imports nerfstudio).

This package imports nothing on its own, so importing one module does not pull in the others.
"""
