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
are priced apart (``fresh_memory``). This module times a step's calls on either device; the
estimator prices with a ``device_calibration.Calibration`` (a :data:`Timer`'s result).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from planner.passes.cpu_timing import time_cold
from planner.passes.cuda_timing import time_back_to_back, workspace_bytes
from planner.passes.device_calibration import Calibration, device_name
from planner.passes.fresh_memory import fresh_memory
from planner.passes.op_call import OpCall
from planner.passes.overhead_fits import call_overhead_s, checkpoint_overhead

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
    CUDA the same runs measure its kernel workspace, which ``cuda_timing.workspace_bytes``
    then gives."""
    return time_each([call], device, repeats)[0]


def time_each(
    calls: Sequence[OpCall], device: torch.device, repeats: int = 5
) -> list[float | None]:
    """:func:`time_call` of each of ``calls``, in order. On the CPU their cold runs go in
    rounds that share one eviction of the caches (``cpu_timing.time_cold``)."""
    if device.type != "cpu":
        return [time_back_to_back(call, device, repeats) for call in calls]
    return time_cold(calls, repeats)


# What ``estimate(..., time_ops=True)`` calls with the step's recorded calls and the device:
# the timing of (at least) those calls.
Timer = Callable[[Sequence[OpCall], torch.device], Calibration]


def measure_timing(calls: Sequence[OpCall], device: torch.device) -> Calibration:
    """The default :data:`Timer`: ``calls`` timed here (cached for this process only), as a
    calibration of ``device`` for no dtype in particular."""
    times = time_calls(calls, device)
    workspaces = {c.key_text: workspace_bytes(c, device) for c in calls}
    fresh = fresh_memory(device)
    return Calibration(
        device=device_name(device),
        torch_version=torch.__version__,
        dtype="",
        call_overhead_s=call_overhead_s(device),
        checkpoint=checkpoint_overhead(device),
        op_times_s={c.key_text: times.get(c.key) for c in calls},
        workspace_bytes={text: n for text, n in workspaces.items() if n},
        fresh_mapping_s_per_byte=fresh.seconds_per_byte,
        source="timed in this process",
        fresh_min_bytes=fresh.min_bytes,
    )
