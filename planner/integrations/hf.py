"""A Hugging Face ``TrainerCallback`` that applies a plan in place and logs its peak.

```python
from planner.integrations.hf import PlanCallback, add_callback

trainer = Trainer(model=model, args=TrainingArguments(..., gradient_checkpointing=False), ...)
add_callback(trainer, PlanCallback("plan.json"))  # or PlanCallback(mem_budget_gb=20, ...)
trainer.train()  # logs: planner/predicted_peak_bytes, planner/measured_peak_bytes
```

- ``PlanCallback(plan)``: ``plan`` an ``InplacePlan`` or the path of a saved one, applied to the
  Trainer's model when training begins (``planner.apply_plan``'s checks: another model is a
  ``PlanFileError``).
- ``PlanCallback(mem_budget_gb=..., largest_shape=(batch, seq))``: planned on the first
  training batch (a forward pre-hook sees it as the model does), tiled to ``largest_shape``
  (``planner.integrations.at_shape``; None: that batch's own shape), then applied before that
  batch's forward runs. ``mem_budget_gb`` is decimal GB, or a share of the predicted eager peak
  (``"50%"``). Planning keeps the random stream (``fork_rng``), so training draws what it would
  without the callback.

The measured peak is ``planner.measurement.StepPeak``'s, from ``on_step_begin`` (or, on the
step that plans, right after planning) to ``on_pre_optimizer_step``: forward, loss, backward
and gradient clipping of one optimizer step, above what was allocated before it (Trainer sets
gradients to None after each step, as the prediction assumes). On CUDA that is the allocator's
``max_memory_allocated`` and costs nothing; on CPU it is the live-storage tracker, a
TorchDispatchMode that slows the steps it watches: ``measure_every_n_steps`` spaces them. Each
log the Trainer writes gets ``planner/budget_bytes``, ``planner/predicted_peak_bytes`` and
``planner/measured_peak_bytes`` (the most measured since the last log); ``add_callback`` puts
the callback first, so that every reporting integration (TensorBoard, W&B) sees them too.
With ``TrainingArguments(bf16=True)`` (or ``fp16=True``) the plan made on the first batch is
priced under ``torch.autocast`` in that dtype, as the Trainer runs the step (``planner.plan``'s
``autocast=``).

With gradient accumulation the measurement spans every micro-batch of the optimizer step: the
gradients the first one makes stay counted, as the prediction counts them.
``TrainingArguments(gradient_checkpointing=True)`` (trl's ``SFTConfig`` default) beside this
callback: Hugging Face's checkpointing is turned off when training begins, with a warning; the
plan checkpoints instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback

from planner import hf_checkpointing
from planner.integrations import PlanCallbackCore


@dataclass(eq=False)
class PlanCallback(PlanCallbackCore, TrainerCallback):
    """Apply a plan to the Trainer's model and log predicted against measured peak (its
    keywords: ``planner.integrations.PlanCallbackCore``; what it does: this module's
    docstring)."""

    measured_bytes: int | None = field(default=None, init=False)  # the most since the last log
    _hook: Any = field(default=None, init=False, repr=False)
    _measuring_step: bool = field(default=False, init=False, repr=False)
    _autocast: torch.dtype | None = field(default=None, init=False, repr=False)  # bf16=/fp16=

    # --- applying ---------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        if getattr(args, "activation_checkpointing", False) or getattr(
            args, "gradient_checkpointing", False
        ):
            # Trainer.train() has just turned it on (SFTConfig does by default)
            warnings.warn(
                "planner: TrainingArguments(gradient_checkpointing=True) turned on Hugging "
                "Face's checkpointing of every layer; PlanCallback turns it off and trains with "
                "the plan. Pass gradient_checkpointing=False to say so.",
                stacklevel=2,
            )
            hf_checkpointing.turn_off(model)
        # Trainer(bf16=True / fp16=True) runs the forward under torch.autocast, entered inside
        # model.forward (accelerate), so the first batch's pre-hook plans outside it
        self._autocast = (
            torch.bfloat16
            if getattr(args, "bf16", False)
            else torch.float16
            if getattr(args, "fp16", False)
            else None
        )
        self._setup(model)
        if self.plan is None and self._hook is None:
            self._hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def _on_forward(
        self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return  # an evaluation before training: plan on a training batch
        self._hook.remove()
        self._hook = None
        if args and kwargs:
            raise ValueError(
                "PlanCallback plans from the model's keyword arguments (a batch dict); this "
                "model was called with positional ones too: plan it yourself with "
                "planner.plan(...) and pass PlanCallback(plan)"
            )
        self._plan_first_batch(model, kwargs if kwargs else args, self._autocast)
        if self._measuring_step and self._meter is not None and not self._meter.running:
            self._meter.start()  # the step's measurement starts with its first forward

    # --- measuring --------------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._measuring_step = self._measures(state.global_step)
        if self._measuring_step and self.plan is not None:
            self._meter.start()  # type: ignore[union-attr]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        peak = self._stop_meter()
        if peak is not None:
            self.measured_bytes = max(peak, self.measured_bytes or 0)
        self._measuring_step = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_meter()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # --- logging ----------------------------------------------------------------------------

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None or "loss" not in logs:
            return  # evaluation and end-of-training summaries carry no step to measure
        extra = self._logs(self.measured_bytes, state.global_step)
        self.measured_bytes = None
        logs.update(extra)
        # Trainer.log copied ``logs`` into the history before the callbacks saw it
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


def add_callback(trainer: Any, callback: PlanCallback) -> PlanCallback:
    """Put ``callback`` first among ``trainer``'s callbacks, so that every other one (the
    reporting integrations among them) sees the numbers it adds to each log."""
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
