"""How every timing reads the clock and how many runs it takes (shared by the CPU's cold runs,
back-to-back runs on an accelerator, and the fits of the overheads around calls)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# A call is repeated until the timed stretch lasts this long, so the clock's resolution and
# Python's own overhead do not swamp microsecond kernels. Of the stretches the fastest counts
# (as timeit advises): other processes only ever slow a run down, and a figure cached for the
# whole process must not keep one moment's load. (A CPU call timed cold, once per run, counts
# its median run instead: ``cpu_timing.cold_cpu_times``.)
MIN_STRETCH_S = 1e-3
# Calls slower than this are timed SLOW_REPEATS times in all (not ``repeats``).
SLOW_CALL_S = 20e-3
SLOW_REPEATS = 3


def clock(device: torch.device) -> Callable[[], float]:
    """The clock calibration times with on ``device``: on a CPU running torch on one thread,
    this process's CPU time, which other processes sharing the core do not stretch (the wall
    clock counts the time they run; the fastest of a few repeats still keeps some of it once a
    call outlasts the scheduler's time slice); else the wall clock (CUDA kernels, or CPU
    kernels spread over threads, whose CPU times add up past the wall time)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def is_slow(first_s: float) -> bool:
    """Whether a call whose first run took ``first_s`` counts as slow (SLOW_CALL_S)."""
    return first_s > SLOW_CALL_S


def repeats_after(first_s: float, repeats: int) -> int:
    """How many more timed runs follow a first one of ``first_s``: a large call (a big batch's
    matmul) varies little run to run, so SLOW_REPEATS in all keep a sweep over batch sizes
    short."""
    return (min(repeats, SLOW_REPEATS) if is_slow(first_s) else repeats) - 1
