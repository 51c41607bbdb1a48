"""CPU calls timed cold: each run on data evicted from the caches, as a call in a step finds it.

Repeated back to back a call finds its arguments in the caches; in a step its inputs were written
ops before and its weights read a step ago: timed hot, GPT-ref's calls summed to 4-6% under their
time in the step. :func:`time_cold` times each call's runs in rounds that share one eviction of
the caches (:func:`cold_cpu_times`) and counts a call's median run, the pages it faulted in taken
off (``fresh_memory`` prices those apart).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from planner.passes.fresh_memory import fault_cost_s, minor_faults
from planner.passes.op_call import OpCall, real_arguments
from planner.passes.timing_runs import clock, is_slow, repeats_after

# The last-level cache assumed where sysfs does not say (``_evict_caches``), and the most
# written to evict one (kept for the process; writing it takes a few milliseconds per run).
DEFAULT_CACHE_BYTES = 32 << 20
MAX_EVICTION_BYTES = 128 << 20


def time_cold(calls: Sequence[OpCall], repeats: int = 5) -> list[float | None]:
    """Seconds per call of each of ``calls`` on the CPU, in order: the median of ``repeats``
    cold runs (:func:`cold_cpu_times`), not cached; None for a call that does not run on random
    tensors. The calls' runs go in rounds that share one eviction of the caches, each round
    holding at most COLD_GROUP_BYTES of arguments."""
    out: list[float | None] = [None] * len(calls)
    group: dict[int, ColdRuns] = {}  # by the call's place in ``calls``

    def time_group() -> None:
        for k, seconds in zip(group, cold_cpu_times(list(group.values()), repeats)):
            out[k] = seconds
        group.clear()

    for k, call in enumerate(calls):
        runs = ColdRuns.prepared(call)
        if runs is None:
            continue  # it does not run on random tensors: priced by the roofline
        if group and sum(r.nbytes for r in group.values()) + runs.nbytes > COLD_GROUP_BYTES:
            time_group()
        group[k] = runs
    time_group()
    return out


# Cold runs of several calls share each eviction of the caches (:func:`cold_cpu_times`); the
# calls of one round hold at most this many bytes of arguments alive meanwhile.
COLD_GROUP_BYTES = 256 << 20


@dataclass
class ColdRuns:
    """One call's cold runs on the CPU (:func:`cold_cpu_times`)."""

    call: OpCall
    args: tuple
    kwargs: dict
    # A second set of arguments it runs on just before each timed run (None: a slow call)
    other: tuple[tuple, dict] | None
    nbytes: int  # of both sets of arguments
    samples: list[tuple[int, float]] = field(default_factory=list)  # (pages faulted, seconds)

    @staticmethod
    def prepared(call: OpCall) -> ColdRuns | None:
        """``call`` on random arguments after a warm-up run (lazy initialisation, allocator
        growth); None when it does not run on them."""
        cpu = torch.device("cpu")
        args, kwargs = real_arguments(call, cpu)
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                call.op(*args, **kwargs)
                slow = is_slow(time.perf_counter() - t0)
                other = None if slow else real_arguments(call, cpu)
                if other is not None:
                    call.op(*other[0], **other[1])
        except Exception:  # noqa: BLE001 - any failure means: price this call by the roofline
            return None
        leaves = tree_leaves((args, kwargs, other))
        nbytes = sum(x.untyped_storage().nbytes() for x in leaves if isinstance(x, torch.Tensor))
        return ColdRuns(call, args, kwargs, other, nbytes)

    def wants_more(self, repeats: int) -> bool:
        return not self.samples or len(self.samples) <= repeats_after(self.samples[0][1], repeats)

    def run(self, now: Callable[[], float]) -> None:
        """A run on the other arguments, then one timed."""
        if self.other is not None:
            self.call.op(*self.other[0], **self.other[1])
        faults = minor_faults()
        t0 = now()
        out = self.call.op(*self.args, **self.kwargs)
        elapsed_s = now() - t0
        self.samples.append((minor_faults() - faults, elapsed_s))
        del out  # after the clock: unmapping a fresh output is not the call's time either

    def typical_s(self) -> float:
        # A run that faulted nothing needs no correction (glibc's threshold for mapping afresh
        # rises as the process frees such blocks: a call's first runs may fault, its later
        # ones not); only where every run faulted is the fault count's price taken off.
        unfaulted = [s for faulted, s in self.samples if not faulted]
        typical_s = statistics.median(
            unfaulted or [s - faulted * fault_cost_s() for faulted, s in self.samples]
        )
        return max(0.0, typical_s - _clock_cost_s())


def cold_cpu_times(group: list[ColdRuns], repeats: int) -> list[float | None]:
    """Seconds per call of each of ``group``: the median of ``repeats`` single runs on the CPU,
    each on data the caches no longer hold but with the code and the dispatcher's state warm,
    as in a training step.

    The median, not the fastest: a step runs each call once, at whatever speed the run gets,
    and on a CPU shared with other machines' work single runs spread widely (one 2048 x 1024
    by 1024 x 256 matmul, 15 cold runs on one VM: 13.2 to 22.5 ms, median 17.4 ms). Priced by
    its calls' fastest runs, GPT-ref's batch-8 step came to 2.60 s and ran in 3.12-3.23 s (its
    matmuls 21-25% over their figures in the step, by the profiler); by their medians, 3.25 s,
    and the same process ran it in 2.96-3.25 s (another calibration: 3.02 s). The CPU clock
    leaves out the time other processes run, which the fastest run was there to drop.

    A call repeated back to back finds its arguments in the caches; in a step they were
    written one or many ops before, weights were last read a layer or a step ago, and the
    output lands in memory freed long since. Timed hot, the calls of GPT-ref's step (8 x 256
    tokens) summed to 4-6% under their time in the step, memory-bound ones (products, sums,
    copies) to half of it; timed after the caches are evicted, within 1% (batch 4: 2%, batch
    1: 6%). The same call on a second set of arguments runs just before each timed one, so
    the code, the dispatcher's tables and the allocator are as warm as in a step, and only the
    data is cold. Not for a ``slow`` call (its warm-up took over SLOW_CALL_S): its own previous
    run leaves the code warm, and what microseconds the code's warmth is worth are nothing
    beside it, while that second run would double what timing a large batch's calls costs.

    The pages a run faults in are taken off, at :func:`fault_cost_s` each. glibc maps a tensor
    of 32 MiB or more afresh unless a free heap chunk fits, so whether a call pays for its
    output's pages follows what the process allocated before, in a step as here (GPT-ref's
    batch-32 step: 0.1 to 6.6 GiB faulted, up to a fifth of its time, from one process to the
    next): the figure is the call's on memory the allocator reuses (README: page faults).

    The runs go in rounds, each call once per round, after one eviction of the caches per
    round: a call's data, untouched since its run in the round before, is as cold after the
    calls before it in this round as after an eviction of its own. Evicting before every run
    (twice the last-level cache written, 2-4 ms) took 3.4 s of GPT-ref's cold plan and most of
    a small model's calibration, which ran microsecond calls.
    """
    now = clock(torch.device("cpu"))
    failed: set[int] = set()
    with torch.no_grad():
        while running := [
            k for k, r in enumerate(group) if k not in failed and r.wants_more(repeats)
        ]:
            _evict_caches()
            for k in running:
                try:
                    group[k].run(now)
                except Exception:  # noqa: BLE001 - as a failed warm-up: priced by the roofline
                    failed.add(k)
    return [None if k in failed else r.typical_s() for k, r in enumerate(group)]


@functools.cache
def _eviction_buffer() -> torch.Tensor:
    # Twice the last-level cache: writing it leaves none of the timed call's data cached.
    return torch.empty(min(2 * _last_level_cache_bytes(), MAX_EVICTION_BYTES) // 4)


def _evict_caches() -> None:
    _eviction_buffer().add_(1.0)


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size as Linux reports it (sysfs), else DEFAULT_CACHE_BYTES."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=DEFAULT_CACHE_BYTES)


@functools.cache
def _clock_cost_s() -> float:
    """What reading the CPU clock twice adds to a timed run (a system call: ~0.7 us in a VM)."""
    now = clock(torch.device("cpu"))
    samples = []
    for _ in range(100):
        t0 = now()
        samples.append(now() - t0)
    return min(samples)
