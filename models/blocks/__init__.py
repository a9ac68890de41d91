"""Blocks built of layers: the sparse MoE block, gated DeltaNet (linear attention), and the CPU's
bfloat16 prompt path over a model's linears."""
