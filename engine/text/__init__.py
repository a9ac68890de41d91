"""Text in and out of the engine: the tokenizer, incremental detokenization, grammars over the
vocabulary, and the sampling defaults a model ships."""
