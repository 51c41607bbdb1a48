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
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback

from planner.integrations import PlanCallbackCore

# Lightning's mixed precisions -> the torch.autocast dtype its training_step runs under
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(eq=False, kw_only=True)
class PlanCallback(PlanCallbackCore, Callback):
    """Apply a plan to a LightningModule's (sub)module and log predicted against measured peak
    (``module``, ``example_input_fn``: this module's docstring; the other keywords:
    ``planner.integrations.PlanCallbackCore``)."""

    module: str = ""
    example_input_fn: Callable[[Any], Any] | None = None

    def _target(self, pl_module: torch.nn.Module) -> torch.nn.Module:
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError:
            raise ValueError(
                f"PlanCallback(module={self.module!r}): {type(pl_module).__name__} has no "
                f"such submodule; name the attribute that holds the model the plan is for"
            ) from None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._setup(self._target(pl_module))

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.plan is None:
            example = self.example_input_fn(batch) if self.example_input_fn else batch
            # precision="bf16-mixed" runs training_step under torch.autocast, this hook not
            autocast = _MIXED.get(str(getattr(trainer, "precision", "")))
            self._plan_first_batch(self._target(pl_module), example, autocast)
        if not self._measures(trainer.global_step):
            return
        if trainer.accumulate_grad_batches == 1:
            # Lightning sets them None itself after the forward, before backward
            pl_module.zero_grad(set_to_none=True)
        self._meter.start()  # type: ignore[union-attr]

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        peak = self._stop_meter()
        if peak is None:
            return
        for name, value in self._logs(peak, trainer.global_step).items():
            pl_module.log(name, float(value), on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop_meter()
