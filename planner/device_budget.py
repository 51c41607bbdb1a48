"""From "my GPU has 80 GB" to the step budget ``planner.plan`` takes, and back.

``plan``'s budget bounds one step's peak *above* what is allocated before the step (DESIGN.md):
parameters and optimizer state are that baseline; activations, temporaries and the parameter
gradients made in backward count against the budget. A device's memory holds both, so

    step budget = device memory - parameters - optimizer state - fp32 master weights - reserve

``step_budget_gb(model, device_memory_gb=80, param_dtype=torch.bfloat16, optimizer="adamw")``
computes it from the model's own parameter counts (trainable ones for the optimizer state: a
LoRA model keeps state for its adapters only); ``device_fit(plan, model, 80, ...)`` says whether
a plan's predicted peak fits that device, and with how much to spare. ``reserve_gb`` is what the
arithmetic leaves out: the CUDA context and allocator fragmentation (typically 0.5-2 GB on a
GPU), and anything else the process keeps on the device.

Under FSDP (``fsdp_world_size=N``) each rank holds 1/N of the parameters and optimizer state.
Gradient accumulation keeps gradients between micro-steps; that is not modelled here (the
plan's peak counts gradients once, as created in backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from planner.plans import GB, Plan, gb_to_bytes
from planner.solvers.errors import InvalidBudgetError

if TYPE_CHECKING:
    from typing_extensions import Unpack

# Tensors of optimizer state per parameter element, each the size of the parameter in the
# state's dtype (torch.optim keeps it in the parameter's dtype; Adam's step count is a CPU
# scalar unless capturable or fused, so it is left out).
OPTIMIZER_STATES = {
    "adamw": 2,  # exp_avg, exp_avg_sq
    "adam": 2,
    "sgd": 0,  # no momentum
    "sgd_momentum": 1,  # momentum_buffer
    "rmsprop": 1,  # square_avg (no momentum, not centered)
    "adagrad": 1,  # sum
    "lion": 1,  # exp_avg
}


class Holding(TypedDict, total=False):
    """What a device holds beside the step: :func:`static_memory`'s options, which
    :func:`step_budget_gb` and :func:`device_fit` take as they are."""

    param_dtype: torch.dtype | None
    optimizer: str
    optimizer_dtype: torch.dtype | None
    master_weights: bool
    reserve_gb: float
    fsdp_world_size: int


@dataclass(frozen=True)
class StaticMemory:
    """What a device holds before a step starts: the baseline ``plan``'s budget sits on."""

    parameter_bytes: int
    optimizer_state_bytes: int
    master_weight_bytes: int  # fp32 copies of low-precision trainable parameters, if kept
    reserve_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.parameter_bytes
            + self.optimizer_state_bytes
            + self.master_weight_bytes
            + self.reserve_bytes
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def static_memory(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype | None = None,
    optimizer: str = "adamw",
    optimizer_dtype: torch.dtype | None = None,
    master_weights: bool = False,
    reserve_gb: float = 0.0,
    fsdp_world_size: int = 1,
) -> StaticMemory:
    """The bytes on the device before a step (per rank under FSDP).

    ``param_dtype``: the dtype the parameters will train in (None: each parameter's own);
    ``optimizer``: one of ``OPTIMIZER_STATES``; ``optimizer_dtype``: its state's dtype (None:
    the parameter's, as torch.optim does); ``master_weights``: an fp32 copy of each trainable
    parameter kept beside low-precision ones (mixed-precision recipes that do so).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer must be one of {', '.join(map(repr, OPTIMIZER_STATES))}, got {optimizer!r}"
        )
    if fsdp_world_size < 1:
        raise ValueError(f"fsdp_world_size must be >= 1, got {fsdp_world_size}")
    if reserve_gb < 0:
        raise ValueError(f"reserve_gb must be >= 0, got {reserve_gb}")
    states = OPTIMIZER_STATES[optimizer]
    param_bytes = state_bytes = master_bytes = 0
    for p in model.parameters():  # tied parameters once
        dtype = param_dtype or p.dtype
        param_bytes += p.numel() * _itemsize(dtype)
        if p.requires_grad:
            state_bytes += states * p.numel() * _itemsize(optimizer_dtype or dtype)
            if master_weights and _itemsize(dtype) < 4:
                master_bytes += p.numel() * 4
    n = fsdp_world_size
    return StaticMemory(
        parameter_bytes=-(-param_bytes // n),
        optimizer_state_bytes=-(-state_bytes // n),
        master_weight_bytes=-(-master_bytes // n),
        reserve_bytes=gb_to_bytes(reserve_gb),
    )


def step_budget_gb(
    model: torch.nn.Module, device_memory_gb: float, **holding: Unpack[Holding]
) -> float:
    """The ``mem_budget_gb`` to plan with so that a step fits a device of ``device_memory_gb``
    (decimal GB) beside the parameters and optimizer state (``holding``: the options of
    :func:`static_memory`). Raises ``InvalidBudgetError`` when those alone fill the device."""
    static = static_memory(model, **holding)
    optimizer = holding.get("optimizer", "adamw")
    left_bytes = gb_to_bytes(device_memory_gb) - static.total_bytes
    if left_bytes <= 0:
        raise InvalidBudgetError(
            f"parameters ({static.parameter_bytes / GB:.2f} GB), {optimizer} state "
            f"({static.optimizer_state_bytes / GB:.2f} GB), master weights "
            f"({static.master_weight_bytes / GB:.2f} GB) and the reserve "
            f"({static.reserve_bytes / GB:.2f} GB) alone fill a {device_memory_gb:g} GB device: "
            f"no step fits. Use lower-precision parameters or optimizer state, fewer trainable "
            f"parameters (LoRA), or shard them (fsdp_world_size)."
        )
    return left_bytes / GB


@dataclass(frozen=True)
class DeviceFit:
    """A plan's predicted peak on a device of a given size: ``str()`` says whether it fits."""

    device_memory_bytes: int
    static: StaticMemory
    step_peak_bytes: int  # the plan's predicted peak above the baseline

    @property
    def total_bytes(self) -> int:
        return self.static.total_bytes + self.step_peak_bytes

    @property
    def spare_bytes(self) -> int:
        """Negative when it does not fit."""
        return self.device_memory_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.spare_bytes >= 0

    def __str__(self) -> str:
        size = f"{self.device_memory_bytes / GB:g} GB"
        device = f"{'an' if size.startswith(('8', '11', '18')) else 'a'} {size} device"
        how = (
            f"fits {device} with {self.spare_bytes / GB:.2f} GB to spare"
            if self.fits
            else f"does not fit {device}: {-self.spare_bytes / GB:.2f} GB over"
        )
        return (
            f"{how} (parameters {self.static.parameter_bytes / GB:.2f} GB + optimizer state "
            f"{self.static.optimizer_state_bytes / GB:.2f} GB + master weights "
            f"{self.static.master_weight_bytes / GB:.2f} GB + reserve "
            f"{self.static.reserve_bytes / GB:.2f} GB + step peak "
            f"{self.step_peak_bytes / GB:.2f} GB)"
        )


def device_fit(
    plan: Plan, model: torch.nn.Module, device_memory_gb: float, **holding: Unpack[Holding]
) -> DeviceFit:
    """Whether ``plan`` (its ``predicted_peak_bytes``) fits a device of ``device_memory_gb``
    beside ``model``'s parameters and optimizer state (``holding``: the options of
    :func:`static_memory`): the reverse of :func:`step_budget_gb`."""
    static = static_memory(model, **holding)
    return DeviceFit(gb_to_bytes(device_memory_gb), static, int(plan.predicted_peak_bytes))
