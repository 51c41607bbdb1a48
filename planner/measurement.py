"""Measure one real training step: forward, loss, backward. The ground truth for every prediction.

``measure(module_or_model, example_input)`` runs the step of ``passes/step.py`` and reports the
peak bytes allocated above the step's starting baseline (DESIGN.md budget semantics: parameters,
buffers, inputs and optimizer state are the baseline; activations, temporaries and the parameter
gradients created in backward count), the bytes autograd keeps for backward, and the wall time.

Three ways to see memory, picked by ``method`` (each in ``planner/step_memory.py``):

- ``"tracker"`` (CPU default): a TorchDispatchMode that adds each new untyped storage's bytes
  when an op first returns it and subtracts them through a ``weakref.finalize`` on the storage.
  Parameters, buffers, inputs and views or in-place results of any pre-existing storage never
  count. Gradients do: they are op outputs inside backward, and the dispatch mode sees backward.
- ``"cuda"`` (CUDA default): the caching allocator's ``max_memory_allocated`` above the starting
  ``memory_allocated``.
- ``"profiler"`` (default for ``torch.compile``-d modules): the allocator's alloc/free events from
  ``torch.profiler.profile(profile_memory=True)``. A dispatch mode would make dynamo skip the
  compiled frame and run eager, so compiled code can only be measured from the allocator side.

Side effects, on purpose none the caller sees: parameter ``.grad`` and buffers (BatchNorm running
statistics) are restored to what they were, and the global RNG state (CPU, and the CUDA device in
use) is put back afterwards, so measuring does not shift the caller's random stream. The steps
themselves draw dropout masks from the caller's stream as it stood (no reseeding), warmup
first. Gradients of input tensors that require grad are not restored.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import statistics
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.passes.step import (
    LossFn,
    StepTime,
    amp_backward,
    amp_forward,
    call,
    split_input,
    taken_input,
    training_loss,
)
from planner.step_memory import LiveStorageTracker, cuda_step, profiled_step, tracked_step

METHODS = ("auto", "tracker", "cuda", "profiler")


@dataclass(frozen=True)
class Measurement:
    """One measured training step; all bytes are above the step's starting baseline."""

    peak_bytes: int
    saved_bytes: int  # kept for backward at the end of forward (after the loss, loss excluded)
    step_time_s: float  # median wall time of an untracked step
    timeline: tuple[tuple[str, int], ...]  # (event label "phase:what", live bytes after it)
    method: str = "tracker"
    peak_event: str = ""


def measure(
    module_or_model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
    *,
    warmup: int = 1,
    repeats: int = 1,
    method: str = "auto",
) -> Measurement:
    """Run one forward + loss + backward step of ``module_or_model`` and measure it.

    ``warmup`` untracked steps run first (they trigger lazy init and torch.compile, which must not
    land inside the measured step), then one memory-measured step, then ``repeats`` timed steps
    without any tracking; ``step_time_s`` is their median. Every step starts with parameter
    gradients set to None so the gradients created in backward count.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    device = _device_of(module_or_model, example_input)
    if method == "auto":
        method = _auto_method(module_or_model, device)
    if method == "tracker" and _is_compiled(module_or_model):
        warnings.warn(
            "method='tracker' runs a torch.compile-d module eager (dynamo skips frames under a "
            "TorchDispatchMode), so this measures the eager model; use method='profiler'",
            stacklevel=2,
        )
    if method == "cuda" and device.type != "cuda":
        raise ValueError(f"method='cuda' needs a CUDA model, this one is on {device}")

    measure_step = {"tracker": tracked_step, "cuda": cuda_step, "profiler": profiled_step}
    with _restored_state(module_or_model, device):
        for _ in range(warmup):
            _step(module_or_model, example_input, loss_fn)
        _clear_grads(module_or_model)
        if method != "tracker":
            # The allocator's and the profiler's counts take in frees of storages older than
            # the step, so garbage collected mid-step would hide bytes; the tracker counts only
            # storages born in the step. A full collection walks every Python object (0.3-0.5 s
            # with transformers imported), so only where it matters.
            gc.collect()
        memory = measure_step[method](module_or_model, example_input, loss_fn, device)
        times = _timed_steps(module_or_model, example_input, loss_fn, device, repeats)
    return Measurement(
        peak_bytes=memory.peak_bytes,
        saved_bytes=memory.saved_bytes,
        step_time_s=times.step_s,
        timeline=memory.timeline,
        method=method,
        peak_event=memory.peak_event,
    )


def _step(module: torch.nn.Module, example_input: Any, loss_fn: LossFn | None) -> None:
    """One untimed, untracked step, from parameter gradients set to None."""
    _clear_grads(module)
    with amp_forward():
        loss = training_loss(call(module, example_input, loss_fn), loss_fn, example_input)
    with amp_backward():
        loss.backward()


def time_step(
    module_or_model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
    *,
    warmup: int = 1,
    repeats: int = 5,
    clock: str = "wall",
) -> StepTime:
    """Wall time of a training step, forward (with the loss) and backward apart, untracked.

    The median of ``repeats`` steps after ``warmup`` ones; state is restored as by :func:`measure`.
    ``clock="cpu"``: this process's CPU time instead (on a shared CPU, what the step cost this
    process without the time other processes ran; one-thread CPU steps only, as a device
    calibration times them, ``passes/timing_runs.clock``).
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    device = _device_of(module_or_model, example_input)
    with _restored_state(module_or_model, device):
        for _ in range(warmup):
            _step(module_or_model, example_input, loss_fn)
        now = time.process_time if clock == "cpu" else time.perf_counter
        return _timed_steps(module_or_model, example_input, loss_fn, device, repeats, now)


def measured_step_time(
    module_or_model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
    *,
    clock: str = "wall",
) -> StepTime | None:
    """The step's time as a planner prices it on its own device: the plain step, and the step
    with the whole forward under one non-reentrant checkpoint, plain and selective
    (``StepTime.checkpointed_s``, ``selective_s``; None if the model cannot run that way).

    A warm-up of each, then rounds of one step of each in turn (enough to fill a tenth of a
    second, 3 to 9) and the median of each: the prices rest on the differences between the
    three, and interleaving makes a load that drifts over the rounds hit them alike. Each timed
    step follows an untimed one of its kind, as in a training loop: a small step timed just
    after another kind's ran 5-7% slower than the same step repeated (tiny Llama, GPT-ref-small;
    from the second step on, it is steady), and the plain step prices every plan. Single
    steps still vary by a few percent on a shared CPU (GPT-ref: 2.27 to 3.05 s for the same
    plain step), so what is fitted from small differences, the selective policy's cost per
    call above all, is approximate. None when the unplanned step does not fit in the device's
    memory (the reason to plan). ``clock`` as for :func:`time_step`."""
    device = _device_of(module_or_model, example_input)
    now = time.process_time if clock == "cpu" else time.perf_counter
    steps = {
        "plain": module_or_model,
        "checkpointed": _CheckpointedWhole(module_or_model),
        "selective": _CheckpointedWhole(module_or_model, selective=True),
    }
    with _restored_state(module_or_model, device):
        try:
            # a warm-up (lazy initialisation, allocator growth), then one to size the rounds
            _timed_steps(module_or_model, example_input, loss_fn, device, 1, now)
            first = _timed_steps(module_or_model, example_input, loss_fn, device, 1, now)
        except torch.cuda.OutOfMemoryError:
            return None
        try:
            for kind in ("checkpointed", "selective"):
                _timed_steps(steps[kind], example_input, loss_fn, device, 1, now)
        except Exception:  # e.g. a forward that cannot run twice alike: recomputation unfitted
            del steps["checkpointed"], steps["selective"]
        rounds = min(9, max(3, math.ceil(0.1 / max(first.step_s, 1e-6))))
        timed: dict[str, list[StepTime]] = {kind: [] for kind in steps}
        for _ in range(rounds):
            for kind, module in steps.items():
                _step(module, example_input, loss_fn)
                timed[kind].append(_timed_steps(module, example_input, loss_fn, device, 1, now))
    plain = StepTime(
        statistics.median(t.forward_s for t in timed["plain"]),
        statistics.median(t.backward_s for t in timed["plain"]),
    )
    if "selective" not in timed:
        return plain
    return dataclasses.replace(
        plain,
        checkpointed_s=statistics.median(t.step_s for t in timed["checkpointed"]),
        selective_s=statistics.median(t.step_s for t in timed["selective"]),
    )


def _recompute_every_op(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _CheckpointedWhole(torch.nn.Module):
    """``inner``'s whole forward under one non-reentrant checkpoint (for timing only); with
    ``selective``, under a selective policy that recomputes every op."""

    def __init__(self, inner: torch.nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.selective = selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = taken_input(self.inner, args, kwargs)
        if self.selective:
            kwargs["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, _recompute_every_op
            )
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _timed_steps(
    module: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None,
    device: torch.device,
    repeats: int,
    now: Any = time.perf_counter,
) -> StepTime:
    forward_s, backward_s = [], []
    # No gc.collect() between steps: walking every Python object evicts the caches and slows
    # the next step of a small model by up to 2x, which a training loop never pays.
    for _ in range(repeats):
        _clear_grads(module)
        _sync(device)
        start_s = now()
        with amp_forward():
            loss = training_loss(call(module, example_input, loss_fn), loss_fn, example_input)
        _sync(device)
        backward_start_s = now()
        with amp_backward():
            loss.backward()
        del loss
        _sync(device)
        forward_s.append(backward_start_s - start_s)
        backward_s.append(now() - backward_start_s)
    # Medians of each phase: they add up to the median step when the phases vary together.
    return StepTime(statistics.median(forward_s), statistics.median(backward_s))


# --- the peak over a stretch of the caller's own loop ------------------------------------------


class StepPeak:
    """The peak bytes above the baseline over a stretch of the caller's own training loop, by
    the same means as :func:`measure`: on CUDA the allocator's ``max_memory_allocated`` above
    the ``memory_allocated`` at :meth:`start`; elsewhere the live-storage tracker, which counts
    the storages born after :meth:`start` (parameters, buffers, optimizer state, the batch and
    gradients that already exist are the baseline). ``start()`` before the step's forward,
    ``stop()`` after its backward (before the optimizer step): what the plan's
    ``predicted_peak_bytes`` predicts, when the step starts with parameter gradients None.

    For training-loop callbacks (``planner.integrations``): the tracker is a TorchDispatchMode,
    entered at ``start`` and left at ``stop``, so the two must nest with any other mode the loop
    enters, and it slows the step it watches (Python per op); the CUDA statistics cost nothing.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.device = _device_of(module, None)
        self.method = "cuda" if self.device.type == "cuda" else "tracker"
        self._tracker: LiveStorageTracker | None = None
        self._base_bytes = 0
        self.running = False

    def start(self) -> None:
        self.running = True
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            self._base_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._tracker = LiveStorageTracker([*self.module.parameters(), *self.module.buffers()])
        self._tracker.__enter__()

    def stop(self) -> int:
        """The peak bytes since :meth:`start`, above what was allocated then."""
        if not self.running:
            raise RuntimeError("StepPeak.stop() without start()")
        self.running = False
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base_bytes
        tracker, self._tracker = self._tracker, None
        assert tracker is not None
        try:
            tracker.__exit__(None, None, None)
        finally:
            tracker.detach()
        return tracker.peak_bytes


# --- helpers -----------------------------------------------------------------------------------


def _device_of(module: torch.nn.Module, example_input: Any) -> torch.device:
    for t in module.parameters():
        return t.device
    args, kwargs = split_input(example_input)
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _auto_method(module: torch.nn.Module, device: torch.device) -> str:
    if _is_compiled(module):
        return "profiler"
    return "cuda" if device.type == "cuda" else "tracker"


def _is_compiled(module: torch.nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    # torch.compile(module) wraps it; module.compile() compiles in place
    return isinstance(module, OptimizedModule) or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clear_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


@contextmanager
def _restored_state(module: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Give back the caller's gradients, buffers and RNG state untouched."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    buffers = list(module.buffers())
    buffer_values = [b.detach().clone() for b in buffers]
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, v in zip(buffers, buffer_values):
                b.copy_(v)
