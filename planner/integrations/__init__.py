"""Training-loop callbacks that apply a plan in place and log its predicted and measured peak.

- ``planner.integrations.hf.PlanCallback``: a Hugging Face ``TrainerCallback`` (``Trainer``,
  PEFT models, trl's ``SFTTrainer``);
- ``planner.integrations.lightning.PlanCallback``: a Lightning ``Callback``.

Both take a plan (an ``InplacePlan`` or the path of a saved one), or a budget to plan with on
the first training batch, tiled to the largest (batch, sequence) shape you will train
(:func:`at_shape`). Neither module is imported by ``import planner``: each imports its
framework. What they share is here (no framework imported): :class:`PlanCallbackCore`, the
options, plan, step meter and logged numbers of both, so that each module is its framework's
hooks alone.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import torch

from planner.hf_checkpointing import applied_plan
from planner.inplace_form import load_inplace
from planner.measurement import StepPeak
from planner.passes.step import LossFn, autocast_for
from planner.plans import InplacePlan

GB = 10**9


def at_shape(batch: Any, shape: tuple[int, int] | None) -> Any:
    """``batch`` with each tensor shaped like its ``input_ids`` (or its first 2-D tensor) tiled
    to ``shape`` = (batch size, sequence length): the largest step to plan for. Rows and
    positions repeat, so padding and labels keep their kind; other values pass unchanged.
    None: ``batch`` as it is."""
    if shape is None:
        return batch
    rows, length = shape
    if isinstance(batch, torch.Tensor):
        return _tile(batch, rows, length) if batch.dim() >= 2 else batch
    if isinstance(batch, dict):
        ref = batch.get("input_ids")
        if not isinstance(ref, torch.Tensor):
            ref = next(
                (t for t in batch.values() if isinstance(t, torch.Tensor) and t.dim() >= 2), None
            )
        if ref is None:
            return batch
        lead = tuple(ref.shape[:2])
        return {
            k: _tile(t, rows, length)
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == lead
            else t
            for k, t in batch.items()
        }
    if isinstance(batch, (tuple, list)):
        return type(batch)(at_shape(t, shape) for t in batch)
    return batch


def _tile(t: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    reps = (math.ceil(rows / t.shape[0]), math.ceil(length / t.shape[1]), *([1] * (t.dim() - 2)))
    return t.repeat(*reps)[:rows, :length].contiguous()


def load_plan(plan: InplacePlan | str | Path) -> InplacePlan:
    """An ``InplacePlan``, or the one saved at a path (``p.save(path)``)."""
    if isinstance(plan, InplacePlan) and plan.form == "inplace":
        return plan
    if isinstance(plan, (str, Path)):
        return load_inplace(plan)
    raise TypeError(
        f"plan must be an InplacePlan (planner.plan(..., form='inplace')) or the path of a saved "
        f"one, got {'a graph plan' if isinstance(plan, InplacePlan) else type(plan).__name__}"
    )


def make_plan(
    model: torch.nn.Module,
    example_input: Any,
    mem_budget_gb: float | str,
    *,
    loss_fn: LossFn | None = None,
    solver: str = "auto",
    device: Any = None,
    autocast: torch.dtype | None = None,
) -> InplacePlan:
    """``planner.plan(model, example_input, ..., form="inplace")``; ``mem_budget_gb`` may also be
    a share of the predicted eager peak, as the command line takes it (``"50%"``).
    ``autocast``: as ``planner.plan``'s (the dtype training runs under ``torch.autocast`` in).

    Planning runs real steps of ``model`` (timing) under ``fork_rng``, so the training's random
    stream (dropout, shuffling) is the same as without the callback."""
    from planner.planning import budget_bytes_from_gb, plan, price_form

    amp = contextlib.nullcontext() if autocast is None else autocast_for(model, autocast)
    with torch.random.fork_rng(devices=_cuda_devices(model)), amp:
        if not isinstance(mem_budget_gb, str):
            return plan(
                model,
                example_input,
                mem_budget_gb,
                solver,
                loss_fn=loss_fn,
                form="inplace",
                device=device,
            )  # type: ignore[return-value]
        text = mem_budget_gb.strip()
        if not text.endswith("%"):
            raise ValueError(
                f"a budget given as text is a share of the eager peak like '50%', got "
                f"{mem_budget_gb!r}"
            )
        priced = price_form(model, example_input, "inplace", loss_fn=loss_fn, device=device)
        budget_bytes = round(float(text[:-1]) / 100 * priced.eager_peak_bytes)
        budget_bytes_from_gb(budget_bytes / GB)  # the same check of the number as plan()
        return priced.plan(budget_bytes, solver)  # type: ignore[return-value]


def _cuda_devices(model: torch.nn.Module) -> list[torch.device]:
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)


def peak_logs(plan: InplacePlan | None, measured_bytes: int | None) -> dict[str, float]:
    """The numbers a callback adds to the training logs (bytes, as ints in floats' place)."""
    logs: dict[str, float] = {}
    if plan is not None:
        logs["planner/budget_bytes"] = plan.budget_bytes
        logs["planner/predicted_peak_bytes"] = plan.predicted_peak_bytes
    if measured_bytes is not None:
        logs["planner/measured_peak_bytes"] = measured_bytes
    return logs


@dataclass(eq=False)  # eq=False: a callback is itself, hashable as the frameworks expect
class PlanCallbackCore:
    """What both ``PlanCallback`` s are beside their framework's hooks.

    ``plan``: an ``InplacePlan`` or a saved plan's path (loaded here: an ``InplacePlan`` once
    built), or None with ``mem_budget_gb`` (decimal GB, or a share of the predicted eager peak
    like ``"50%"``) to plan on the first training batch, tiled to ``largest_shape`` (batch,
    sequence; :func:`at_shape`), with ``loss_fn``, ``solver`` and ``device`` as for
    ``planner.plan``. ``measure``: measure the step's peak (``planner.measurement.StepPeak``)
    every ``measure_every_n_steps`` optimizer steps. ``history``: every logged set of numbers
    (:func:`peak_logs`), with its ``"step"``.
    """

    plan: InplacePlan | str | Path | None = None
    _: KW_ONLY
    mem_budget_gb: float | str | None = None
    largest_shape: tuple[int, int] | None = None
    loss_fn: LossFn | None = None
    solver: str = "auto"
    device: Any = None
    measure: bool = True
    measure_every_n_steps: int = 1
    history: list[dict[str, float]] = field(default_factory=list, init=False, repr=False)
    _meter: StepPeak | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.plan is None) == (self.mem_budget_gb is None):
            raise ValueError(
                "give PlanCallback either a plan (an InplacePlan or a saved plan's path) or "
                "mem_budget_gb= to plan on the first training batch, not both or neither"
            )
        if self.measure_every_n_steps < 1:
            raise ValueError(
                f"measure_every_n_steps must be >= 1, got {self.measure_every_n_steps}"
            )
        if self.plan is not None:
            self.plan = load_plan(self.plan)

    def _setup(self, model: torch.nn.Module) -> None:
        """Training begins on ``model``: apply the plan given (unless it is applied already)
        and make the step meter."""
        if self.plan is not None and applied_plan(model) is not self.plan:
            self.plan.apply(model)
        self._meter = StepPeak(model) if self.measure else None

    def _plan_first_batch(
        self, model: torch.nn.Module, batch: Any, autocast: torch.dtype | None
    ) -> None:
        """Plan ``model`` on ``batch`` (the first training batch, as the model takes it) under
        the framework's ``autocast`` dtype, and apply the plan."""
        plan = make_plan(
            model,
            at_shape(batch, self.largest_shape),
            self.mem_budget_gb,  # type: ignore[arg-type]
            loss_fn=self.loss_fn,
            solver=self.solver,
            device=self.device,
            autocast=autocast,
        )
        plan.apply(model)
        self.plan = plan

    def _measures(self, step: int) -> bool:
        """Whether optimizer step ``step`` is measured."""
        return self._meter is not None and step % self.measure_every_n_steps == 0

    def _stop_meter(self) -> int | None:
        """The measured step's peak bytes (None: no step was being measured)."""
        if self._meter is None or not self._meter.running:
            return None
        return self._meter.stop()

    def _logs(self, measured_bytes: int | None, step: int) -> dict[str, float]:
        """The numbers to log at ``step`` (:func:`peak_logs`), kept in ``history`` too."""
        logs = peak_logs(self.plan, measured_bytes)  # type: ignore[arg-type]
        self.history.append({**logs, "step": step})
        return logs
