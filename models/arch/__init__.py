"""Architectures: the decoder skeleton, the Llama family, Qwen3-Next / Qwen3.5-MoE, their tensor-
parallel shards, the registry by HF model_type and the built-in shapes."""
