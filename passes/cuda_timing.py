"""Timing back to back, as on CUDA: a call repeated in stretches of runs, the kernels waited for,
and the fastest stretch per run; the same runs measure each call's kernel workspace.

On an accelerator kernels queue behind one another as in a step, so a call timed back to back is
a call as the step runs it. (On the CPU the same timing leaves a call's data in the caches, which
a step does not: ``cpu_timing`` times CPU calls cold, and only the stand-in chain of
``overhead_fits``, whose tiny tensors stay cached through its step, is timed back to back there.)

The runs measure memory no fake tensor shows: on CUDA a kernel may allocate scratch through the
caching allocator inside its call and free it before returning (cuDNN convolutions' workspaces,
reductions' scratch, dropout's and log-softmax's buffers), which ``planner.measure`` counts in the
step's peak. :func:`workspace_bytes` is that transient, per call: what the call's peak allocation
reached above its inputs and outputs. It is 0 wherever no CUDA kernel ran: on the CPU (whose
kernels' scratch ``planner.measure`` does not count there either), for a call that would not run
on random tensors, and whenever no device is timed at all (a device profile such as "h100", a
meta model, a plan without ``time_ops``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from planner.passes.op_call import OpCall, real_arguments
from planner.passes.timing_runs import MIN_STRETCH_S, clock, repeats_after

# (device, OpCall.key) -> the call's kernel workspace, measured as it was timed (CUDA only)
_WORKSPACE_BYTES: dict[tuple[str, tuple], int] = {}


def time_back_to_back(call: OpCall, device: torch.device, repeats: int) -> float | None:
    """Seconds per call of ``call`` on ``device``, the fastest of ``repeats`` stretches of
    back-to-back runs (:func:`stretch_s`), not cached; None for a call that does not run on
    random tensors. On CUDA the same runs measure its kernel workspace (:func:`workspace_bytes`).
    On the CPU this times the call with its data left in the caches (a CPU call timed cold:
    ``cpu_timing.time_cold``)."""
    args, kwargs = real_arguments(call, device)
    try:
        with torch.no_grad():
            call.op(*args, **kwargs)  # warm-up: lazy initialisation, allocator growth
            if device.type == "cuda":  # after the warm-up: no lazy set-up, no algorithm search
                torch.cuda.synchronize(device)
                _note_transient_bytes(call, args, kwargs, device)
            return stretch_s(lambda: call.op(*args, **kwargs), device, repeats)
    except Exception:  # any failure means: price this call by the roofline
        return None


def stretch_s(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` stretches of back-to-back runs (MIN_STRETCH_S each), per run:
    on an accelerator, where kernels queue behind one another as in a step, and for calls whose
    data stays in the CPU's caches."""
    now = clock(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = now()
    run()
    sync()
    once_s = now() - t0
    n = max(1, int(MIN_STRETCH_S / max(once_s, 1e-7)))
    samples = [once_s] if n == 1 else []
    for _ in range(repeats_after(once_s, repeats) + 1 - len(samples)):
        t0 = now()
        for _ in range(n):
            run()
        sync()
        samples.append((now() - t0) / n)
    return min(samples)


def workspace_bytes(call: OpCall, device: torch.device) -> int:
    """The bytes ``call`` allocates on ``device`` beyond its inputs and outputs and frees
    before it returns (module docstring), as measured when it was timed there, or by
    :func:`measure_workspace_bytes` (the most any run saw). 0 on the CPU, for a call not run on
    ``device`` in this process, and for one that did not run on random tensors."""
    return _WORKSPACE_BYTES.get((str(device), call.key), 0)


def measure_workspace_bytes(call: OpCall, device: torch.device) -> int:
    """:func:`workspace_bytes` of ``call`` measured now by one untimed run on random tensors
    (after a warm-up), for a call priced without timing it (a batch sweep's scaled calls:
    scratch need not grow with the rows as time does). 0 on the CPU."""
    if device.type != "cuda":
        return 0
    args, kwargs = real_arguments(call, device)
    try:
        with torch.no_grad():
            call.op(*args, **kwargs)  # warm-up: lazy initialisation, algorithm search
            _note_transient_bytes(call, args, kwargs, device)
    except Exception:  # noqa: BLE001 - as timing: a call that fails on random tensors
        return 0
    return workspace_bytes(call, device)


def _note_transient_bytes(call: OpCall, args: tuple, kwargs: dict, device: torch.device) -> None:
    """One run of ``call`` on its (real, CUDA) arguments: the most the caching allocator held
    during it above what it held after it with the outputs still alive, kept for
    :func:`workspace_bytes` (the most any run saw). The arguments are held throughout, so
    nothing is freed by the call but its scratch; ``before`` matters only for a call that
    returns less than it was given (none frees an argument). Resets the device's peak
    statistics (``torch.cuda.reset_peak_memory_stats``)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call.op(*args, **kwargs)
    after = torch.cuda.memory_allocated(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    key = (str(device), call.key)
    _WORKSPACE_BYTES[key] = max(peak - max(before, after), _WORKSPACE_BYTES.get(key, 0))
