"""CUDA graphs: decode steps per batch and context bucket, verify steps (drafts), lone prompts' prefills,
and the one owner that chooses, captures and replays them."""
