"""Op timing: run the graph's own aten ops once on the real device and time them.

In: the aten calls ``passes/estimate.py`` saw during its fake run (``op_call.OpCall``: the op and
its arguments, tensors reduced to shape, stride and dtype). Out: seconds per call, measured on
random tensors of those shapes on the device, as Rockmate prices its graph. Identical calls
(the same op on the same shapes, as in every block of a transformer) are timed once per process
and share one figure, so identical blocks get identical prices.

Why measure instead of the roofline: on a real device the roofline misses what dominates eager
kernels below their peak (small matmuls, pointwise ops that fit in cache, launch and dispatch
overhead). A call that cannot run on random tensors (a data-dependent op) is left out of the
result, and the estimator prices it by the roofline instead.

The jobs, one file each: on the CPU each timed run finds its data evicted from the caches, as a
call in a step does (``cpu_timing``); on an accelerator calls are timed back to back and their
kernel workspaces measured (``cuda_timing``); what a step spends around its calls (per call, per
checkpoint region) is fitted on stand-ins (``overhead_fits``); the pages of blocks mapped afresh
are priced apart (``fresh_memory``). This module times a step's calls on either device and hands
the estimator a :class:`DeviceTiming`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.passes.cpu_timing import time_cold
from planner.passes.cuda_timing import time_back_to_back, workspace_bytes
from planner.passes.fresh_memory import FreshMemory, fresh_memory
from planner.passes.op_call import OpCall
from planner.passes.overhead_fits import (
    CheckpointOverhead,
    call_overhead_s,
    checkpoint_overhead,
    host_overlaps,
)

# (device, OpCall.key) -> seconds, or None for a call that would not run on random tensors
_TIMES: dict[tuple[str, tuple], float | None] = {}


def time_calls(
    calls: Iterable[OpCall], device: torch.device, repeats: int = 5
) -> dict[tuple, float]:
    """Seconds per call of each distinct call, of ``repeats`` runs on ``device``
    (:func:`time_call`)."""
    calls = list(calls)
    new = {c.key: c for c in calls if (str(device), c.key) not in _TIMES}
    for key, seconds in zip(new, time_each(list(new.values()), device, repeats)):
        _TIMES[(str(device), key)] = seconds
    times: dict[tuple, float] = {}
    for call in calls:
        seconds = _TIMES[(str(device), call.key)]
        if seconds is not None:
            times[call.key] = seconds
    return times


def time_call(call: OpCall, device: torch.device, repeats: int = 5) -> float | None:
    """Seconds per call of ``call`` on ``device`` (on the CPU the median of ``repeats`` runs,
    each on data evicted from the caches; elsewhere the fastest of ``repeats`` stretches of
    back-to-back runs), not cached; None for a call that does not run on random tensors. On
    CUDA the same runs measure its kernel workspace, which :func:`workspace_bytes` then
    gives."""
    return time_each([call], device, repeats)[0]


def time_each(
    calls: Sequence[OpCall], device: torch.device, repeats: int = 5
) -> list[float | None]:
    """:func:`time_call` of each of ``calls``, in order. On the CPU their cold runs go in
    rounds that share one eviction of the caches (``cpu_timing.time_cold``)."""
    if device.type != "cpu":
        return [time_back_to_back(call, device, repeats) for call in calls]
    return time_cold(calls, repeats)


@dataclass(frozen=True)
class DeviceTiming:
    """What the estimator takes of a device's calibration, as plain data (no torch objects):
    seconds per call of each call timed (by :attr:`OpCall.key_text`; None: it did not run on
    random tensors, price it by the roofline), seconds a step spends per call around the call
    itself (:func:`call_overhead_s`), the checkpoint bookkeeping (:func:`checkpoint_overhead`),
    the calls' kernel workspaces (:func:`workspace_bytes`), and the cost of blocks the
    allocator maps afresh (:class:`FreshMemory`).

    ``planner/calibration.py`` keeps one per device, in the process and on disk, and hands it to
    ``estimate`` / ``eager_graph`` through their ``timer``.
    """

    op_times_s: Mapping[str, float | None] = field(default_factory=dict)
    call_overhead_s: float = 0.0
    checkpoint: CheckpointOverhead = CheckpointOverhead()
    source: str = ""  # where it came from, for the graph's meta["timing"]
    # The step itself, timed whole (``passes.step.StepTime``: plain, checkpointed, selective),
    # when it was cheap enough to time; the estimator fits the calls' times to it.
    step_time: Any = None
    # Kernel workspace bytes of the calls that have one (:func:`workspace_bytes`), by
    # :attr:`OpCall.key_text`; a call not listed has none (always so off CUDA).
    workspace_bytes: Mapping[str, int] = field(default_factory=dict)
    # What the blocks a call allocates cost when the allocator maps them afresh
    fresh_memory: FreshMemory = FreshMemory()
    # The host's per-call work overlaps the kernels (:func:`host_overlaps`): each call costs at
    # least ``call_overhead_s`` rather than that much more
    host_overlaps: bool = False


# What ``estimate(..., time_ops=True)`` calls with the step's recorded calls and the device:
# the timing of (at least) those calls.
Timer = Callable[[Sequence[OpCall], torch.device], DeviceTiming]


def measure_timing(calls: Sequence[OpCall], device: torch.device) -> DeviceTiming:
    """The default :data:`Timer`: ``calls`` timed here (cached for this process only)."""
    times = time_calls(calls, device)
    workspaces = {c.key_text: workspace_bytes(c, device) for c in calls}
    return DeviceTiming(
        op_times_s={c.key_text: times.get(c.key) for c in calls},
        call_overhead_s=call_overhead_s(device),
        checkpoint=checkpoint_overhead(device),
        source="timed in this process",
        workspace_bytes={text: n for text, n in workspaces.items() if n},
        fresh_memory=fresh_memory(device),
        host_overlaps=host_overlaps(device),
    )
