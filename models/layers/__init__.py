"""Layers: linears (dense, FP8, packed blocks), norms, rope, pointwise ops, the paged-attention
backends and the per-layer slot states."""
