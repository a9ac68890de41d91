"""Tensor parallel: rank 0's sharded runner and workers, the worker processes, their graphs in
lockstep, and the split's admission."""
