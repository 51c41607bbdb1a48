"""The training step that planner plans and measures: forward, a loss, backward.

Shared by ``passes/estimate.py`` and ``planner/measurement.py`` so both price the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from planner.solvers.errors import UnsupportedModelError

ExampleInput = torch.Tensor | tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class StepTime:
    """Median wall times of untracked training steps, split where backward starts."""

    forward_s: float  # the module's forward and the loss
    backward_s: float
    # The same step with the module's whole forward under one checkpoint (None: not measured):
    # what recomputation really costs on this device, beside the ops' forward.
    checkpointed_s: float | None = None
    # ... and under a selective policy that recomputes every op: what the policy's per-op
    # dispatch adds (None: not measured).
    selective_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s


def split_input(example_input: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A tensor, a tuple/list of tensors, or a dict of keyword tensors -> (args, kwargs)."""
    if isinstance(example_input, torch.Tensor):
        return (example_input,), {}
    if isinstance(example_input, Mapping):
        return (), dict(example_input)
    if isinstance(example_input, (tuple, list)):
        return tuple(example_input), {}
    raise TypeError(
        f"example_input must be a tensor, a tuple of tensors or a dict of keyword tensors, "
        f"got {type(example_input).__name__}"
    )


def call(module: torch.nn.Module, example_input: Any) -> Any:
    args, kwargs = split_input(example_input)
    return module(*args, **kwargs)


def floating_leaves(output: Any) -> list[torch.Tensor]:
    """Floating-point tensors in a (nested) output, dicts and ModelOutputs included."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in floating_leaves(v)]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in floating_leaves(v)]
    return []


def training_loss(output: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """The scalar the step differentiates.

    ``loss_fn(output)`` when given; else the model's own ``loss`` (Hugging Face style, a
    ``.loss`` attribute or a ``"loss"`` key); else the sum of every floating output.
    """
    if loss_fn is not None:
        return loss_fn(output)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in floating_leaves(output) if t.requires_grad]
    if not leaves:
        what = (
            f"a {output.dtype} tensor"
            if isinstance(output, torch.Tensor)
            else type(output).__name__
        )
        raise UnsupportedModelError(
            f"the model's output ({what}) holds no floating tensor that "
            f"requires grad, so there is no loss to differentiate; say how to compute the loss: "
            f"loss_fn=... (a function of the model's output, returning a scalar tensor), on the "
            f"command line --loss MODULE:FUNCTION"
        )
    return sum(t.sum() for t in leaves)
