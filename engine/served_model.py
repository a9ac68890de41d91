"""What an engine tells about the model it serves: its name, tokenizer, config and sampling
defaults. The `Engine` is one (it adds the thread that runs the steps)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ballast.engine.detok import Detokenizer
from ballast.engine.loading import LoadedModel
from ballast.engine.sampling_defaults import sampling_defaults as defaults_for
from ballast.engine.tokenizer import Tokenizer


class ServedModel:
    """The model-facing half of `EngineLike`, from what loading found."""

    _loaded: LoadedModel  # set once the model is loaded
    model_name: str
    vocab_size: int  # width of the logits the sampler draws from (may exceed the tokenizer's)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded.tokenizer.get()

    @property
    def hf_config(self) -> dict[str, object]:
        """The model's Hugging Face-style config dict (from config.json, the GGUF, or built in)."""
        return dict(self._loaded.hf_config)

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, float]:
        """Sampling values for what a request omits (generation_config.json, or GGUF defaults)."""
        source = self._loaded.source
        return defaults_for(source.kind, source.path)

    def new_detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> Detokenizer:
        return self.tokenizer.new_detokenizer(prompt_ids, stop)
