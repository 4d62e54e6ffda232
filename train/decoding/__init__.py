"""The decoding engine: one batched decoder (plain and tree-speculative), one KV cache, one
proposal path for chain, fixed and dynamic trees, one module of acceptance rules and sampling.

Below train/ (the recipe), data_prep/ (regeneration) and evaluation/ (eval, calibration) in the
layers; it needs only torch, transformers and the heads (docs/architecture.md)."""
