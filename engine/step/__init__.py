"""One step's data on the engine thread: the batch built from a plan, the sampler that draws from its
logits, and the pipeline that overlaps one step with the next."""
