"""ballast: an OpenAI-compatible LLM inference server with memory governance built in."""

__version__ = "0.1.0"
