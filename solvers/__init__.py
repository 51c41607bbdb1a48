"""Checkpoint solvers: pure functions over a CostGraph. Never imports torch."""
