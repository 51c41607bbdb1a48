"""planner: automatic activation checkpointing for PyTorch training."""
