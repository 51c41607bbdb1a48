"""Every cache this process keeps, listed in one place, and one way to clear them all.

A plan reuses what an earlier one in the same process measured or solved: op timings, the
device's fitted overheads, calibrations, priced models, dp's solved levels. ``clear_caches()``
drops them all, so the next plan measures and solves as a fresh process would (the calibration
files on disk stay). ``tests/planner/test_caches.py`` checks that no module-level cache in
planner, passes or solvers is missing from :data:`CLEARED` or :data:`KEPT`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProcessCache:
    """A module-level cache: ``attribute`` of ``module`` (a dict, or a ``functools.cache``)."""

    module: str
    attribute: str
    holds: str

    def target(self) -> Any:
        return getattr(importlib.import_module(self.module), self.attribute)

    def clear(self) -> None:
        target = self.target()
        if hasattr(target, "cache_clear"):
            target.cache_clear()
        else:
            target.clear()


_PASSES = "planner.passes."
CLEARED: tuple[ProcessCache, ...] = (
    ProcessCache(_PASSES + "op_timing", "_TIMES", "each op call's time, by device"),
    ProcessCache(_PASSES + "cuda_timing", "_WORKSPACE_BYTES", "each CUDA call's kernel workspace"),
    ProcessCache(_PASSES + "overhead_fits", "_OVERHEAD_S", "the host's time per aten call"),
    ProcessCache(_PASSES + "overhead_fits", "_CHECKPOINT_OVERHEAD", "the checkpoint overhead"),
    ProcessCache(_PASSES + "fresh_memory", "_mapping_costs_s", "a fresh page's fault, unmap"),
    ProcessCache(_PASSES + "fresh_memory", "_at_start_up", "glibc's mmap threshold"),
    ProcessCache(_PASSES + "cpu_timing", "_eviction_buffer", "written to evict the CPU's caches"),
    ProcessCache(_PASSES + "cpu_timing", "_clock_cost_s", "what reading the CPU clock adds"),
    ProcessCache("planner.calibration", "_PROCESS", "calibrations read or measured"),
    ProcessCache("planner.pricing_cache", "_PRICED", "the last few models' pricings"),
    ProcessCache("planner.devices", "_MEASURED", "the device's measured rates"),
    ProcessCache("planner.solvers.dp_search", "_SOLVED_CACHE", "dp's solved levels"),
    ProcessCache("planner.solvers.dp_search", "_LEAST_CACHE", "dp's least feasible budgets"),
)

# Module-level tables that are not caches of what was measured or solved, and stay.
KEPT: tuple[ProcessCache, ...] = (
    ProcessCache("planner.calibration_counts", "MEASUREMENTS", "a count of what was measured"),
    ProcessCache("planner.devices", "PROFILES", "the named devices' datasheet rates"),
    ProcessCache(
        "planner.inplace",
        "_TRACED_KEYS",
        "compiled selective regions' keys: cleared, a compiled model's regions would retrace",
    ),
    ProcessCache("planner.inplace", "_TRACED", "compiled selective regions, held weakly"),
    ProcessCache("planner.devices", "_GPU_PEAKS", "the named GPUs' datasheet peaks"),
    ProcessCache("planner.devices", "_GPU_CAPABILITY", "the named GPUs' compute capabilities"),
    ProcessCache("planner.passes.trace", "_FLOP_FORMULAS", "torch's FLOP formulas, by op"),
    ProcessCache("planner.solvers.registry", "SOLVERS", "the solvers, by name"),
)


def clear_caches() -> None:
    """Forget what this process measured and solved (every cache in :data:`CLEARED`): the next
    plan measures and solves as in a fresh process. Calibration files on disk stay."""
    for cache in CLEARED:
        cache.clear()
