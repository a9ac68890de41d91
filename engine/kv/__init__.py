"""The KV block pool and what lives beside it: the block allocator, the pool's memory grants, the
prefix cache and its checkpoints, parked (preempted) sequences."""
