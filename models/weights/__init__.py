"""Weights from files: GGUF (reader, quants, tokenizer, loader), Hugging Face safetensors directories
(whole or sharded), and the embedded default model."""
