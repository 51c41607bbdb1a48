"""Op timing: run the graph's own aten ops once on the real device and time them.

In: the aten calls ``passes/estimate.py`` saw during its fake run (:class:`OpCall`: the op and its
arguments, tensors reduced to shape, stride and dtype). Out: seconds per call, measured on
random tensors of those shapes on the device, as Rockmate prices its graph. Identical calls
(the same op on the same shapes, as in every block of a transformer) are timed once per process
and share one figure, so identical blocks get identical prices. On the CPU each timed run finds
its data evicted from the caches, as a call in a step does (its inputs written ops before, its
weights read a step ago): repeated back to back, GPT-ref's calls summed to 4-6% under their
time in the step.

Why measure instead of the roofline: on a real device the roofline misses what dominates eager
kernels below their peak (small matmuls, pointwise ops that fit in cache, launch and dispatch
overhead). A call that cannot run on random tensors (a data-dependent op) is left out of the
result, and the estimator prices it by the roofline instead.

A call timed alone misses what a training step spends around it: autograd recording the call,
the backward engine scheduling it, Python. On the CPU that is tens of microseconds per call and
dominates small models, so :func:`call_overhead_s` measures it once per device (a chain of tiny
ops stepped for real) and the estimator adds it per call. On CUDA the host's work overlaps the
kernels (:func:`host_overlaps`): a call costs the longer of its kernel and the host's time per
call, which bounds small models (an H200 ran a 2-layer GPT's step in 5.7 ms, its kernels alone
in 4.9 ms, and checkpointed plans 1.7-3.5x slower than their kernels, 2026-11-27). Likewise
each checkpoint region costs its own bookkeeping (saved-tensor hooks, RNG state, the
recomputation's set-up): :func:`checkpoint_overhead` measures that once per device.

A timed call leaves out the pages it faults in (a call on memory the allocator reuses), and
:class:`FreshMemory` prices them apart: on a CPU, glibc maps each block of 32 MiB or more
afresh, and a step pays for a share of its large blocks' pages whichever calls allocate them.

The same runs measure memory no fake tensor shows: on CUDA a kernel may allocate scratch
through the caching allocator inside its call and free it before returning (cuDNN
convolutions' workspaces, reductions' scratch, dropout's and log-softmax's buffers), which
``planner.measure`` counts in the step's peak. :func:`workspace_bytes` is that transient, per
call: what the call's peak allocation reached above its inputs and outputs. It is 0 wherever
no CUDA kernel ran: on the CPU (whose kernels' scratch ``planner.measure`` does not count
there either), for a call that would not run on random tensors, and whenever no device is
timed at all (a device profile such as "h100", a meta model, a plan without ``time_ops``).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import mmap
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from planner.passes.offload import host_apart, offloaded_call

try:
    import resource
except ImportError:  # Windows: no fault count, and no page faults taken off
    resource = None  # type: ignore[assignment]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class OpCall:
    """One aten call with its tensors reduced to :class:`TensorSpec` (hashable: the cache key)."""

    op: Any  # torch._ops.OpOverload
    leaves: tuple[Any, ...]
    spec: TreeSpec  # how to rebuild (args, kwargs) from the leaves

    @cached_property
    def key(self) -> tuple[str, str, tuple[Any, ...]]:
        """Calls with equal keys share one timing. Cached: a long unrolled graph asks for the
        keys of tens of thousands of calls, and a TreeSpec's text is slow to build."""
        if getattr(self.op, "is_view", False):
            # A view only writes metadata, so its integer arguments (select's index, a slice's
            # bounds) do not change its time: a scan unrolled over the sequence selects at every
            # position, and those calls share one timing instead of one each.
            tensors = tuple(x for x in self.leaves if isinstance(x, TensorSpec))
            return (str(self.op), "view", tensors)
        return (str(self.op), str(self.spec), self.leaves)

    @cached_property
    def key_text(self) -> str:
        """:attr:`key` as text, the same in every process: how a calibration stores the call."""
        return repr(self.key)


# Calls whose time does not depend on the position they write, and that position's argument:
# the backward of a scan unrolled over the sequence takes select_backward at every position
# (Mamba-128: 257 of the 536 distinct calls), timed once at position 0 instead of once each.
_POSITION_ARGUMENT = {torch.ops.aten.select_backward.default: 3}


def op_call(
    op: Any, args: tuple, kwargs: dict, flat: tuple[list[Any], TreeSpec] | None = None
) -> OpCall | None:
    """The call of ``op`` on these (fake) arguments; None when one cannot be rebuilt.

    ``flat``: ``tree_flatten((args, kwargs))`` when the caller has it already.
    """
    k = _POSITION_ARGUMENT.get(op)
    if k is not None and k < len(args) and isinstance(args[k], int):
        args, flat = (*args[:k], 0, *args[k + 1 :]), None
    leaves, spec = tree_flatten((args, kwargs)) if flat is None else flat
    out: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append(TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype))
        elif x is None or isinstance(
            x, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
        ):
            out.append(x)
        else:
            return None  # a generator, a symbolic size...: price it by the roofline
    return OpCall(op, tuple(out), spec)


# (device, OpCall.key) -> seconds, or None for a call that would not run on random tensors
_TIMES: dict[tuple[str, tuple], float | None] = {}
# (device, OpCall.key) -> the call's kernel workspace, measured as it was timed (CUDA only)
_WORKSPACE_BYTES: dict[tuple[str, tuple], int] = {}
# A call is repeated until the timed stretch lasts this long, so the clock's resolution and
# Python's own overhead do not swamp microsecond kernels. Of the stretches the fastest counts
# (as timeit advises): other processes only ever slow a run down, and a figure cached for the
# whole process must not keep one moment's load. (A CPU call timed cold, once per run, counts
# its median run instead: :func:`_cold_cpu_times`.)
MIN_STRETCH_S = 1e-3
# Calls slower than this are timed SLOW_REPEATS times in all (not ``repeats``).
SLOW_CALL_S = 20e-3
SLOW_REPEATS = 3
# The last-level cache assumed where sysfs does not say (``_evict_caches``), and the most
# written to evict one (kept for the process; writing it takes a few milliseconds per run).
DEFAULT_CACHE_BYTES = 32 << 20
MAX_EVICTION_BYTES = 128 << 20


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


def _real(x: Any, device: torch.device, generator: torch.Generator) -> Any:
    if not isinstance(x, TensorSpec):
        return x if not isinstance(x, torch.device) else device
    size = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride)) if all(x.shape) else 0
    if x.dtype.is_floating_point or x.dtype.is_complex:
        flat = _random_floats(size, generator).to(device=device, dtype=x.dtype)
    elif x.dtype == torch.bool:
        # Half False then half True: masks in models (causal, padding) come in long runs that
        # a kernel's branches predict; random bits priced GPT-ref's causal masked_fill at 2.7
        # times its time in the step.
        flat = torch.arange(size, device=device) >= size // 2
    else:
        flat = torch.zeros(size, dtype=x.dtype, device=device)  # valid indices, class 0
    return flat.as_strided(x.shape, x.stride)


# Random values beyond this many are the first ones repeated: a kernel's time does not depend
# on which values it reads, and drawing a large batch's inputs one normal at a time took
# longer than timing the calls themselves.
RANDOM_BLOCK = 1 << 16


def _random_floats(size: int, generator: torch.Generator) -> torch.Tensor:
    block = torch.randn(min(size, RANDOM_BLOCK), generator=generator)
    if size <= RANDOM_BLOCK:
        return block
    return block.repeat(-(-size // RANDOM_BLOCK))[:size]


def clock(device: torch.device) -> Callable[[], float]:
    """The clock calibration times with on ``device``: on a CPU running torch on one thread,
    this process's CPU time, which other processes sharing the core do not stretch (the wall
    clock counts the time they run; the fastest of a few repeats still keeps some of it once a
    call outlasts the scheduler's time slice); else the wall clock (CUDA kernels, or CPU
    kernels spread over threads, whose CPU times add up past the wall time)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


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
    rounds that share one eviction of the caches (:func:`_cold_cpu_times`)."""
    if device.type != "cpu":
        return [_time_call(call, device, repeats) for call in calls]
    out: list[float | None] = [None] * len(calls)
    group: dict[int, _ColdRuns] = {}  # by the call's place in ``calls``

    def time_group() -> None:
        for k, seconds in zip(group, _cold_cpu_times(list(group.values()), repeats)):
            out[k] = seconds
        group.clear()

    for k, call in enumerate(calls):
        runs = _ColdRuns.prepared(call)
        if runs is None:
            continue  # it does not run on random tensors: priced by the roofline
        if group and sum(r.nbytes for r in group.values()) + runs.nbytes > COLD_GROUP_BYTES:
            time_group()
        group[k] = runs
    time_group()
    return out


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
    args, kwargs = _real_arguments(call, device)
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


def _real_arguments(call: OpCall, device: torch.device) -> tuple[Any, Any]:
    """``call``'s arguments as real tensors on ``device``, random values (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    leaves = [_real(x, device, generator) for x in call.leaves]
    return tree_unflatten(leaves, call.spec)


def _time_call(call: OpCall, device: torch.device, repeats: int) -> float | None:
    """Back to back: on an accelerator, or on the CPU with its data left in the caches (a CPU
    call timed cold: :func:`time_each`)."""
    args, kwargs = _real_arguments(call, device)
    try:
        with torch.no_grad():
            call.op(*args, **kwargs)  # warm-up: lazy initialisation, allocator growth
            if device.type == "cuda":  # after the warm-up: no lazy set-up, no algorithm search
                torch.cuda.synchronize(device)
                _note_transient_bytes(call, args, kwargs, device)
            return _stretch_s(lambda: call.op(*args, **kwargs), device, repeats)
    except Exception:  # any failure means: price this call by the roofline
        return None


def _repeats_after(first_s: float, repeats: int) -> int:
    """How many more timed runs follow a first one of ``first_s``: a large call (a big batch's
    matmul) varies little run to run, so SLOW_REPEATS in all keep a sweep over batch sizes
    short."""
    return (min(repeats, SLOW_REPEATS) if first_s > SLOW_CALL_S else repeats) - 1


def _stretch_s(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` stretches of back-to-back runs (MIN_STRETCH_S each), per run:
    on an accelerator, where kernels queue behind one another as in a step, and for calls whose
    data stays in the CPU's caches (``hot``)."""
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
    for _ in range(_repeats_after(once_s, repeats) + 1 - len(samples)):
        t0 = now()
        for _ in range(n):
            run()
        sync()
        samples.append((now() - t0) / n)
    return min(samples)


# Cold runs of several calls share each eviction of the caches (:func:`_cold_cpu_times`); the
# calls of one round hold at most this many bytes of arguments alive meanwhile.
COLD_GROUP_BYTES = 256 << 20


@dataclass
class _ColdRuns:
    """One call's cold runs on the CPU (:func:`_cold_cpu_times`)."""

    call: OpCall
    args: tuple
    kwargs: dict
    # A second set of arguments it runs on just before each timed run (None: a slow call)
    other: tuple[tuple, dict] | None
    nbytes: int  # of both sets of arguments
    samples: list[tuple[int, float]] = field(default_factory=list)  # (pages faulted, seconds)

    @staticmethod
    def prepared(call: OpCall) -> _ColdRuns | None:
        """``call`` on random arguments after a warm-up run (lazy initialisation, allocator
        growth); None when it does not run on them."""
        cpu = torch.device("cpu")
        args, kwargs = _real_arguments(call, cpu)
        try:
            with torch.no_grad():
                t0 = time.perf_counter()
                call.op(*args, **kwargs)
                slow = time.perf_counter() - t0 > SLOW_CALL_S
                other = None if slow else _real_arguments(call, cpu)
                if other is not None:
                    call.op(*other[0], **other[1])
        except Exception:  # noqa: BLE001 - any failure means: price this call by the roofline
            return None
        leaves = tree_leaves((args, kwargs, other))
        nbytes = sum(x.untyped_storage().nbytes() for x in leaves if isinstance(x, torch.Tensor))
        return _ColdRuns(call, args, kwargs, other, nbytes)

    def wants_more(self, repeats: int) -> bool:
        return not self.samples or len(self.samples) <= _repeats_after(self.samples[0][1], repeats)

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


def _cold_cpu_times(group: list[_ColdRuns], repeats: int) -> list[float | None]:
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


def minor_faults() -> int:
    """The page faults this process has taken that mapped memory without reading a disk."""
    return 0 if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# How malloc maps a large block: memory of this process alone (Python's default, a shared
# mapping, faults its pages in at 1.7 times the cost here).
_PRIVATE_ANONYMOUS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def fault_cost_s() -> float:
    """CPU seconds the first touch of a fresh page costs (the kernel zeroes and maps it)."""
    return _mapping_costs_s()[0]


@functools.cache
def _mapping_costs_s() -> tuple[float, float]:
    """Per page of a fresh mapping: what its first touch costs, and what unmapping it costs. A
    fresh 64 MiB mapping written twice, the first write's excess per fault, then closed; the
    median of three such mappings, as another process's memory traffic stretches one or the
    other."""
    if resource is None:  # no fault count (Windows): nothing to take off or add
        return 0.0, 0.0
    now = clock(torch.device("cpu"))

    def once() -> tuple[float, float]:
        region = mmap.mmap(-1, 64 << 20, flags=_PRIVATE_ANONYMOUS)
        pages = torch.frombuffer(region, dtype=torch.uint8)
        faults = minor_faults()
        t0 = now()
        pages.fill_(1)
        first_s = now() - t0
        faults = minor_faults() - faults
        t0 = now()
        pages.fill_(2)
        again_s = now() - t0
        del pages  # before the mapping closes
        t0 = now()
        region.close()
        unmap_s = now() - t0
        if not faults:
            return 0.0, 0.0
        return max(0.0, first_s - again_s) / faults, unmap_s / faults

    fault_s, unmap_s = zip(*(once() for _ in range(3)))
    return statistics.median(fault_s), statistics.median(unmap_s)


def fresh_mapping_s_per_byte() -> float:
    """What a block of memory mapped afresh costs a step per byte: its pages faulted in on
    first touch, and unmapped when it is freed (``FreshMemory``)."""
    return sum(_mapping_costs_s()) / mmap.PAGESIZE


# glibc's malloc maps a block afresh (mmap) when no free heap chunk fits it and it is at least
# its threshold, which starts at 128 KiB and rises to each such block freed up to this (on a
# 64-bit machine), where it stays: in a training loop, every block of 32 MiB or more.
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 << 20
# The share of a step's blocks mapped afresh that it pays for (``FreshMemory``): between none
# (each lands in a free heap chunk a tensor freed before left) and all; which follows the
# heap's history and moves from step to step. The pages a step faulted over the bytes of its
# blocks of 32 MiB or more, five models' eager steps, each in a process of its own (python -m
# benchmarks.page_faults): GPT-ref at batch 32, 0.41; at 64, 0.31; a 4-layer GPT of width
# 512, 0.51; an MLP of 8192 x 2048 rows, 1.04; pointwise ops on 32 MiB blocks, 1.00. Their
# mean; GPT-ref's planned steps at batch 32 and 64 (fit_batch's benchmark) faulted 0.38, 0.78.
FRESH_SHARE = 0.65


@dataclass(frozen=True)
class FreshMemory:
    """What a CPU step pays for blocks its allocator maps afresh at every allocation, and
    unmaps at every free, instead of reusing memory: their pages, faulted in zeroed on first
    touch. With glibc's defaults that is every block of 32 MiB or more: at GPT-ref's batch 64
    a fifth of the step's CPU time (README: page faults).

    ``min_bytes``: the smallest block mapped afresh (None: the allocator reuses every size, as
    glibc does with ``MALLOC_MMAP_MAX_=0``, or jemalloc, or CUDA's caching allocator);
    ``seconds_per_byte``: :func:`fresh_mapping_s_per_byte`, measured on this machine.
    """

    min_bytes: int | None = None
    seconds_per_byte: float = 0.0

    def cost_s(self, allocated_bytes: Iterable[int]) -> float:
        """Seconds a call that allocates blocks of these sizes pays for them (FRESH_SHARE of
        those mapped afresh)."""
        if self.min_bytes is None:
            return 0.0
        fresh_bytes = sum(n for n in allocated_bytes if n >= self.min_bytes)
        return FRESH_SHARE * fresh_bytes * self.seconds_per_byte


def mapped_afresh_min_bytes(device: torch.device) -> int | None:
    """The smallest block this process's allocator for ``device`` maps afresh (``FreshMemory``):
    on Linux, glibc's, as its settings in the environment the process started with leave it
    (:func:`glibc_mapped_afresh_min_bytes`; a process that calls ``mallopt`` itself is not
    seen); None for another device or C library."""
    if device.type != "cpu" or platform.libc_ver()[0] != "glibc":
        return None
    return _at_start_up()


@functools.cache
def _at_start_up() -> int | None:
    # glibc reads its settings once, as the process starts: a later change to os.environ
    # changes nothing
    return glibc_mapped_afresh_min_bytes(os.environ)


def glibc_mapped_afresh_min_bytes(env: Mapping[str, str]) -> int | None:
    """The smallest block glibc's malloc maps afresh under the settings in ``env``: 32 MiB by
    default (GLIBC_MMAP_THRESHOLD_MAX_BYTES), ``MALLOC_MMAP_THRESHOLD_`` (or the tunable
    ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``) where set; None where
    ``MALLOC_MMAP_MAX_=0`` (or ``glibc.malloc.mmap_max=0``) turns mapping off, or another
    allocator preloaded in its place (jemalloc, tcmalloc, mimalloc) keeps freed memory."""
    if any(name in env.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return None
    tunables = dict(
        item.partition("=")[::2] for item in env.get("GLIBC_TUNABLES", "").split(":") if item
    )
    mmap_max = env.get("MALLOC_MMAP_MAX_", tunables.get("glibc.malloc.mmap_max"))
    threshold = env.get("MALLOC_MMAP_THRESHOLD_", tunables.get("glibc.malloc.mmap_threshold"))
    try:
        if mmap_max is not None and int(mmap_max) == 0:
            return None
        return GLIBC_MMAP_THRESHOLD_MAX_BYTES if threshold is None else int(threshold)
    except ValueError:  # glibc ignores a malformed setting, and so does this
        return GLIBC_MMAP_THRESHOLD_MAX_BYTES


def fresh_memory(device: torch.device) -> FreshMemory:
    """:class:`FreshMemory` of ``device`` in this process, its cost measured here."""
    min_bytes = mapped_afresh_min_bytes(device)
    if min_bytes is None:
        return FreshMemory()
    return FreshMemory(min_bytes, fresh_mapping_s_per_byte())


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


_OVERHEAD_S: dict[str, float] = {}


def host_overlaps(device: torch.device) -> bool:
    """Whether the host's work around a call overlaps the device's: on an accelerator the
    kernels run while the host prepares the next call, so a call costs the longer of the two;
    on the CPU the host is the device, and the two add up."""
    return device.type != "cpu"


def host_floor_s(alone_s: Sequence[float], total_s: float) -> float:
    """The host's seconds per call ``h`` at which calls costing ``max(alone, h)`` each add up to
    ``total_s`` (0 when their times alone already reach it): on an accelerator, the per-call
    host time that a step's measured time implies (:func:`host_overlaps`)."""
    ordered = sorted(alone_s)
    above_s = sum(ordered)  # the calls at or above h keep their own times
    if not ordered or above_s >= total_s:
        return 0.0
    for below, a in enumerate(ordered, start=1):
        above_s -= a
        floor_s = (total_s - above_s) / below
        if below == len(ordered) or floor_s <= ordered[below]:
            return floor_s
    raise AssertionError("unreachable: the last call bounds the search")


def _best_step_s(step: Callable[[], None], repeats: int, device: torch.device) -> float:
    now = clock(device)

    def timed() -> float:
        t0 = now()
        step()
        if device.type == "cuda":  # the host's work and the kernels it queued
            torch.cuda.synchronize(device)
        return now() - t0

    timed()  # warm-up
    return min(timed() for _ in range(repeats))  # see MIN_STRETCH_S: the machine's own speed


@dataclass(frozen=True)
class CheckpointOverhead:
    """What a non-reentrant checkpoint region adds to a step beyond recomputing its ops.

    ``region_s`` once per region (frames, RNG state, the recomputation's set-up);
    ``per_saving_node_s`` for each node in it that saves for backward (the saved-tensor hooks run
    for it in forward, again in the recomputation, and on unpacking in backward);
    ``per_selective_call_s`` for each aten call of a selective region (its policy's dispatch
    mode sees every op, in forward and in the recomputation). An offload region instead costs
    ``offload_region_s`` once and ``per_offloaded_storage_s`` for each storage it sends to the
    host and fetches back (hooks, pinned buffers, copies, events).
    """

    region_s: float = 0.0
    per_saving_node_s: float = 0.0
    per_selective_call_s: float = 0.0
    offload_region_s: float = 0.0
    per_offloaded_storage_s: float = 0.0


_CHECKPOINT_OVERHEAD: dict[str, CheckpointOverhead] = {}


def checkpoint_overhead(
    device: torch.device, regions: int = 16, repeats: int = 9
) -> CheckpointOverhead:
    """The checkpoint overhead on ``device``, fitted on chains of tiny regions (1 and 8 layers of
    two saving ops each) stepped plain, checkpointed and selectively checkpointed: each step's
    excess over the plain step and one more forward (the recomputation). Between regions, in
    every variant, runs a layer of work no region holds (``FILLER_WIDTH``), as in a model.
    Measured once per process and device: on CUDA too, where the tiny kernels leave the
    host's bookkeeping as what the steps take.
    """
    key = str(device)
    if key not in _CHECKPOINT_OVERHEAD:
        _CHECKPOINT_OVERHEAD[key] = measure_checkpoint_overhead(device, regions, repeats)
    return _CHECKPOINT_OVERHEAD[key]


def measure_checkpoint_overhead(
    device: torch.device, regions: int = 16, repeats: int = 9
) -> CheckpointOverhead:
    """:func:`checkpoint_overhead` measured now, not cached."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    selective = functools.partial(create_selective_checkpoint_contexts, recompute_all)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=generator).to(device)
    z0 = torch.randn(FILLER_ROWS, FILLER_WIDTH, generator=generator).to(device)
    fillers = [
        (torch.randn(FILLER_WIDTH, FILLER_WIDTH, generator=generator) / FILLER_WIDTH**0.5)
        .to(device)
        .requires_grad_()
        for _ in range(regions)
    ]

    def excess_s(layers: int) -> tuple[float, float]:
        weights = [
            [
                torch.randn(16, generator=generator).to(device).requires_grad_()
                for _ in range(layers)
            ]
            for _ in range(regions)
        ]

        def block(y: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
            for w in ws:
                y = torch.tanh(y * w)  # two ops, each saving for backward
            return y

        def step(how: str) -> None:
            y, z = x, z0
            for ws, filler in zip(weights, fillers):
                if how == "plain":
                    y = block(y, *ws)
                elif how == "checkpoint":
                    y = checkpoint(block, y, *ws, use_reentrant=False)
                elif how == "offload":
                    y = offloaded_call(block, _NO_MODULE, y, *ws)
                else:
                    y = checkpoint(block, y, *ws, use_reentrant=False, context_fn=selective)
                z = torch.nn.functional.gelu(
                    torch.nn.functional.layer_norm(z @ filler, (FILLER_WIDTH,))
                )
            (y.sum() + z.sum()).backward()
            for w in (*fillers, *(w for ws in weights for w in ws)):
                w.grad = None

        def forward() -> None:
            y = x
            for ws in weights:
                y = block(y, *ws)

        def best_s(run: Callable[[], None]) -> float:
            return _best_step_s(run, repeats, device)

        plain_s = best_s(lambda: step("plain"))
        recompute_s = best_s(forward)
        checkpoint_s = best_s(lambda: step("checkpoint")) - plain_s - recompute_s
        selective_s = best_s(lambda: step("selective")) - plain_s - recompute_s
        # offload recomputes nothing, and sends nothing where the host's memory is the device's
        offload_s = best_s(lambda: step("offload")) - plain_s if host_apart(device) else 0.0
        return checkpoint_s / regions, selective_s / regions, offload_s / regions

    few_s, few_selective_s, few_offload_s = excess_s(1)
    many_s, many_selective_s, many_offload_s = excess_s(8)
    per_saving_node_s = max(0.0, (many_s - few_s) / (2 * 8 - 2))
    per_selective_call_s = max(0.0, (many_selective_s - many_s) / (2 * 8))
    # each layer's tanh output is the one storage it sends (the mul saves the layer's input and
    # weight: the region's argument or the last tanh's output, already sent)
    per_offloaded_storage_s = max(0.0, (many_offload_s - few_offload_s) / (8 - 1))
    return CheckpointOverhead(
        region_s=max(0.0, few_s - 2 * per_saving_node_s),
        per_saving_node_s=per_saving_node_s,
        per_selective_call_s=per_selective_call_s,
        offload_region_s=max(0.0, few_offload_s - per_offloaded_storage_s),
        per_offloaded_storage_s=per_offloaded_storage_s,
    )


# The layer of work between two regions of the stand-in (a matmul, a layer norm and a GELU on
# FILLER_ROWS x FILLER_WIDTH), in every variant. Back to back, a checkpoint's own Python and
# autograd bookkeeping stays in the core's caches from one region to the next and costs less
# than half what it does in a model: 137 us per region here without it, 308 us with it, and
# 300-350 us per region of one GELU or layer norm measured in GPT-ref-small's step.
FILLER_ROWS, FILLER_WIDTH = 32, 256

# offloaded_call's module: the tiny chains' weights are its arguments, kept on the device
_NO_MODULE = torch.nn.Module()


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[OpCall | None] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        self.calls.append(op_call(func, args, kwargs))
        return func(*args, **kwargs)


def call_overhead_s(device: torch.device, blocks: int = 16, repeats: int = 15) -> float:
    """Seconds a training step spends per aten call beyond the call itself (module docstring):
    on the CPU added to each call's time, on an accelerator the host's time per call, which
    each call takes at least (:func:`host_overlaps`). Measured once per process and device."""
    key = str(device)
    if key not in _OVERHEAD_S:
        _OVERHEAD_S[key] = measure_call_overhead_s(device, blocks, repeats)
    return _OVERHEAD_S[key]


def measure_call_overhead_s(device: torch.device, blocks: int = 16, repeats: int = 15) -> float:
    """:func:`call_overhead_s` measured now, not cached."""
    torch.manual_seed(0)
    # Modules as models use them (a linear, a norm, an activation, dropout): their Python and
    # autograd costs are what a step pays per call; width 16 keeps the kernels themselves tiny.
    layers = [
        layer
        for _ in range(blocks)
        for layer in (torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
    ]
    chain = torch.nn.Sequential(*layers, torch.nn.Dropout(0.1)).to(device)
    x = torch.randn(4, 16, device=device)

    def step() -> None:
        chain(x).sum().backward()
        for p in chain.parameters():
            p.grad = None

    step_s = _best_step_s(step, repeats, device)
    with _Recorder() as recorder:
        step()
    alone: dict[tuple, float | None] = {}
    for c in recorder.calls:
        if c is not None and c.key not in alone:
            # back to back, as the chain's tiny tensors stay in the caches through its step
            alone[c.key] = _time_call(c, device, 5)
    alone_s = [alone.get(c.key) or 0.0 if c is not None else 0.0 for c in recorder.calls]
    if host_overlaps(device):
        return host_floor_s(alone_s, step_s)
    return max(0.0, (step_s - sum(alone_s)) / len(recorder.calls))


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
