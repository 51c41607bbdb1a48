"""Fresh memory on the CPU: what the pages of a block the allocator maps afresh cost a step.

A timed call leaves out the pages it faults in (a call on memory the allocator reuses:
``cpu_timing``), and :class:`FreshMemory` prices them apart: on a CPU, glibc maps each block of
32 MiB or more afresh, and a step pays for a share of its large blocks' pages whichever calls
allocate them.
"""

from __future__ import annotations

import functools
import mmap
import os
import platform
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from planner.passes.timing_runs import clock

try:
    import resource
except ImportError:  # Windows: no fault count, and no page faults taken off
    resource = None  # type: ignore[assignment]


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
