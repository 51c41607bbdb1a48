"""How a measured step's memory is seen, one way per ``planner.measure`` method.

Each runs one forward + loss + backward step and returns its peak bytes above the step's
starting baseline, the bytes kept for backward at the end of the forward (loss excluded), a
timeline of (event label "phase:what", live bytes after it) and the event at the peak:

- :func:`tracked_step` (``"tracker"``): :class:`LiveStorageTracker`, a TorchDispatchMode that
  counts the storages born in the step;
- :func:`cuda_step` (``"cuda"``): the caching allocator's own statistics;
- :func:`profiled_step` (``"profiler"``): the profiler's allocation events, which work under
  ``torch.compile`` (a dispatch mode would make dynamo skip the compiled frame).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from planner.passes.step import (
    LossFn,
    amp_backward,
    amp_forward,
    call,
    split_input,
    training_loss,
)
from planner.passes.trace import allocated_bytes


@dataclass(frozen=True)
class StepMemory:
    """One step's memory as a method saw it; bytes above the step's starting baseline."""

    peak_bytes: int
    saved_bytes: int  # kept for backward at the end of forward (after the loss, loss excluded)
    timeline: tuple[tuple[str, int], ...]  # (event label "phase:what", live bytes after it)
    peak_event: str


# --- the CPU live-storage tracker --------------------------------------------------------------


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        # DTensor (FSDP2's parameters) lists its device mesh next to its local tensor
        inner = [getattr(t, a) for a in attrs]
        return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x)]
    if t.is_sparse or t.layout != torch.strided or t.device.type == "meta":
        return []
    return [t.untyped_storage()]


class LiveStorageTracker(TorchDispatchMode):
    """Live bytes of the storages created while active, and their peak, op by op."""

    def __init__(self, baseline: list[torch.Tensor]) -> None:
        super().__init__()
        self.phase = "forward"
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_event = ""
        self.timeline: list[tuple[str, int]] = []
        # storage -> [bytes counted] for storages born in the step, None for baseline storages
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._finalizers: list[weakref.finalize] = []
        for t in baseline:
            for st in _storages(t):
                self._seen[st] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        input_ids = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            for st in _storages(t):
                cell = self._seen.get(st, False)
                if cell is None:
                    continue  # a baseline storage (parameter, buffer, input) or a view of one
                if cell is not False:
                    self._resized(st, cell)
                    continue
                if input_ids is None:
                    input_ids = {
                        id(s)
                        for a in tree_leaves((args, kwargs))
                        if isinstance(a, torch.Tensor)
                        for s in _storages(a)
                    }
                if id(st) in input_ids:
                    # a view or in-place result of a storage that predates the step
                    self._seen[st] = None
                    continue
                self._born(st)
        self.mark(f"{self.phase}:{func}")
        return out

    def __enter__(self) -> LiveStorageTracker:
        # torch.utils.checkpoint stashes the CPU RNG state per call (preserve_rng_state) and
        # fork_rng copies it again around a recomputation: real CPU allocations that no op
        # dispatches, so they are counted as torch.get_rng_state returns them.
        self._get_rng_state = torch.get_rng_state

        def get_rng_state() -> torch.Tensor:
            state = self._get_rng_state()
            self._born(state.untyped_storage())
            return state

        torch.get_rng_state = get_rng_state
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.get_rng_state = self._get_rng_state
        super().__exit__(*exc)

    def _born(self, st: torch.UntypedStorage) -> None:
        cell = [st.nbytes()]
        self._seen[st] = cell
        self._finalizers.append(weakref.finalize(st, self._died, cell))
        self.live_bytes += cell[0]

    def _resized(self, st: torch.UntypedStorage, cell: list[int]) -> None:
        nbytes = st.nbytes()
        if nbytes != cell[0]:  # resize_ on an out= argument or a storage we already count
            self.live_bytes += nbytes - cell[0]
            cell[0] = nbytes

    def _died(self, cell: list[int]) -> None:
        self.live_bytes -= cell[0]

    def mark(self, label: str) -> None:
        self.timeline.append((label, self.live_bytes))
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_event = self.live_bytes, label

    def detach(self) -> None:
        """Stop listening for frees: storages still alive (gradients) outlive the tracker."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()


def baseline_tensors(module: torch.nn.Module, example_input: Any) -> list[torch.Tensor]:
    args, kwargs = split_input(example_input)
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return [*module.parameters(), *module.buffers(), *inputs]


def tracked_step(
    module: torch.nn.Module, example_input: Any, loss_fn: LossFn | None, device: torch.device
) -> StepMemory:
    tracker = LiveStorageTracker(baseline_tensors(module, example_input))
    try:
        with tracker:
            with amp_forward():
                output = call(module, example_input, loss_fn)
                tracker.phase = "loss"
                loss = training_loss(output, loss_fn, example_input)
                del output  # whatever backward needs, autograd keeps alive
            tracker.mark("loss:end")
            saved_bytes = tracker.live_bytes - loss.untyped_storage().nbytes()
            tracker.phase = "backward"
            with amp_backward():
                loss.backward()
            del loss
            tracker.mark("backward:end")
    finally:
        tracker.detach()
    return StepMemory(tracker.peak_bytes, saved_bytes, tuple(tracker.timeline), tracker.peak_event)


# --- CUDA: the caching allocator's own statistics ----------------------------------------------


class _AllocatedLog(TorchDispatchMode):
    """Timeline only: ``memory_allocated`` above the baseline after every op."""

    def __init__(self, device: torch.device, base_bytes: int) -> None:
        super().__init__()
        self.device, self.base_bytes, self.phase = device, base_bytes, "forward"
        self.timeline: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.log(f"{self.phase}:{func}")
        return out

    def log(self, label: str) -> None:
        self.timeline.append((label, torch.cuda.memory_allocated(self.device) - self.base_bytes))


def cuda_step(
    module: torch.nn.Module, example_input: Any, loss_fn: LossFn | None, device: torch.device
) -> StepMemory:
    torch.cuda.synchronize(device)
    base_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    log = _AllocatedLog(device, base_bytes)
    with log:
        with amp_forward():
            output = call(module, example_input, loss_fn)
            log.phase = "loss"
            loss = training_loss(output, loss_fn, example_input)
            del output
        log.log("loss:end")
        loss_bytes = allocated_bytes(loss)
        saved_bytes = torch.cuda.memory_allocated(device) - base_bytes - loss_bytes
        log.phase = "backward"
        with amp_backward():
            loss.backward()
        del loss
        log.log("backward:end")
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.max_memory_allocated(device) - base_bytes
    peak_event = max(log.timeline, key=lambda e: e[1])[0] if log.timeline else ""
    return StepMemory(peak_bytes, saved_bytes, tuple(log.timeline), peak_event)


# --- the profiler's allocation events (works under torch.compile) ------------------------------


def profiled_step(
    module: torch.nn.Module, example_input: Any, loss_fn: LossFn | None, device: torch.device
) -> StepMemory:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        with amp_forward():
            with record_function("planner::forward"):
                output = call(module, example_input, loss_fn)
            with record_function("planner::loss"):
                loss = training_loss(output, loss_fn, example_input)
                del output
        loss_bytes = loss.untyped_storage().nbytes()
        with record_function("planner::backward"), amp_backward():
            loss.backward()
            del loss
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    events = prof.profiler.kineto_results.events()
    ranges_ns = {e.name(): (e.start_ns(), e.end_ns()) for e in events if e.name() in _PHASES}
    device_type = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    allocs = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and e.device_type() == device_type
    )
    live_bytes = peak_bytes = 0
    saved_bytes = None
    peak_event = ""
    timeline: list[tuple[str, int]] = []
    loss_end_ns = ranges_ns["planner::loss"][1]
    for t_ns, nbytes in allocs:
        if saved_bytes is None and t_ns > loss_end_ns:
            saved_bytes = live_bytes - loss_bytes
            timeline.append(("loss:end", live_bytes))
        live_bytes += nbytes
        label = f"{_phase_at(t_ns, ranges_ns)}:{'alloc' if nbytes > 0 else 'free'}"
        timeline.append((label, live_bytes))
        if live_bytes > peak_bytes:
            peak_bytes, peak_event = live_bytes, label
    if saved_bytes is None:
        saved_bytes = live_bytes - loss_bytes
    timeline.append(("backward:end", live_bytes))
    return StepMemory(peak_bytes, saved_bytes, tuple(timeline), peak_event)


_PHASES = ("planner::forward", "planner::loss", "planner::backward")


def _phase_at(t_ns: int, ranges_ns: dict[str, tuple[int, int]]) -> str:
    for name in _PHASES:
        start_ns, end_ns = ranges_ns.get(name, (0, -1))
        if start_ns <= t_ns <= end_ns:
            return name.removeprefix("planner::")
    return "backward"  # autograd's device threads may run past the record_function range
