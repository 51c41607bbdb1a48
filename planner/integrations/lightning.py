"""A Lightning ``Callback`` that applies a plan in place and logs its peak.

```python
from planner.integrations.lightning import PlanCallback

trainer = L.Trainer(callbacks=[PlanCallback("plan.json", module="model")], ...)
trainer.fit(lit_module)  # logs planner/predicted_peak_bytes, planner/measured_peak_bytes
```

``module``: the path of the submodule the plan is for, inside the LightningModule (``"model"``
for ``self.model = AutoModelForCausalLM...``; ``""``: the LightningModule itself).

- ``PlanCallback(plan, module=...)``: ``plan`` an ``InplacePlan`` or a saved plan's path,
  applied in ``setup`` (the model-setup hook, before the optimizers are configured and before
  any strategy wraps the module; ``planner.apply_plan``'s checks).
- ``PlanCallback(mem_budget_gb=..., largest_shape=(batch, seq), module=...)``: planned in
  ``on_train_batch_start`` on the first training batch, tiled to ``largest_shape``
  (``planner.integrations.at_shape``), and applied before that batch's ``training_step``.
  ``example_input_fn(batch)`` turns a batch into the module's example input when the batch is
  not already what the module takes (a tensor, a tuple, or a dict of keyword tensors); the
  step's loss is the module's ``.loss`` (Hugging Face with labels), else ``loss_fn``.
  Under ``precision="bf16-mixed"`` (or ``"16-mixed"``) it is priced under ``torch.autocast``
  in that dtype, as ``training_step`` runs (``planner.plan``'s ``autocast=``).

The measured peak is ``planner.measurement.StepPeak``'s from ``on_train_batch_start`` to
``on_before_optimizer_step``: forward, loss and backward of one batch above what was allocated
before it (on CUDA the allocator's ``max_memory_allocated``; on CPU the live-storage tracker,
which slows the steps it watches: ``measure_every_n_steps`` spaces them). Lightning sets
gradients to None only after the forward, so with ``accumulate_grad_batches=1`` the callback
sets them None at batch start (what Lightning does anyway before backward), so that the
allocator's baseline is the prediction's. Each measured step logs ``planner/budget_bytes``,
``planner/predicted_peak_bytes`` and ``planner/measured_peak_bytes`` with ``pl_module.log``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from planner.hf_checkpointing import applied_plan
from planner.integrations import at_shape, callback_plan, make_plan, peak_logs
from planner.measurement import StepPeak
from planner.passes.step import LossFn
from planner.plans import InplacePlan

# Lightning's mixed precisions -> the torch.autocast dtype its training_step runs under
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class PlanCallback(Callback):
    """Apply a plan to a LightningModule's (sub)module and log predicted against measured peak."""

    def __init__(
        self,
        plan: InplacePlan | str | Path | None = None,
        *,
        module: str = "",
        mem_budget_gb: float | str | None = None,
        largest_shape: tuple[int, int] | None = None,
        example_input_fn: Callable[[Any], Any] | None = None,
        loss_fn: LossFn | None = None,
        solver: str = "auto",
        device: Any = None,
        measure: bool = True,
        measure_every_n_steps: int = 1,
    ) -> None:
        self.plan: InplacePlan | None = callback_plan(plan, mem_budget_gb, measure_every_n_steps)
        self.module_path = module
        self.mem_budget_gb = mem_budget_gb
        self.largest_shape = largest_shape
        self.example_input_fn = example_input_fn
        self.loss_fn, self.solver, self.device = loss_fn, solver, device
        self.measure, self.measure_every_n_steps = measure, measure_every_n_steps
        self.history: list[dict[str, float]] = []  # every measured step's numbers, with "step"
        self._meter: StepPeak | None = None

    def _target(self, pl_module: torch.nn.Module) -> torch.nn.Module:
        try:
            return pl_module.get_submodule(self.module_path)
        except AttributeError:
            raise ValueError(
                f"PlanCallback(module={self.module_path!r}): {type(pl_module).__name__} has no "
                f"such submodule; name the attribute that holds the model the plan is for"
            ) from None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        target = self._target(pl_module)
        if self.plan is not None and applied_plan(target) is not self.plan:
            self.plan.apply(target)
        if self.measure:
            self._meter = StepPeak(target)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        target = self._target(pl_module)
        if self.plan is None:
            example = self.example_input_fn(batch) if self.example_input_fn else batch
            self.plan = make_plan(
                target,
                at_shape(example, self.largest_shape),
                self.mem_budget_gb,  # type: ignore[arg-type]
                loss_fn=self.loss_fn,
                solver=self.solver,
                device=self.device,
                # precision="bf16-mixed" runs training_step under torch.autocast, this hook not
                autocast=_MIXED.get(str(getattr(trainer, "precision", ""))),
            )
            self.plan.apply(target)
        if self._meter is None or trainer.global_step % self.measure_every_n_steps:
            return
        if trainer.accumulate_grad_batches == 1:
            # Lightning sets them None itself after the forward, before backward
            pl_module.zero_grad(set_to_none=True)
        self._meter.start()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._meter is None or not self._meter.running:
            return
        logs = peak_logs(self.plan, self._meter.stop())
        for name, value in logs.items():
            pl_module.log(name, float(value), on_step=True, on_epoch=False)
        self.history.append({**logs, "step": trainer.global_step})

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._meter is not None and self._meter.running:
            self._meter.stop()
