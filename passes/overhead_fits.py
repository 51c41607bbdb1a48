"""What a training step spends around its calls, fitted on stand-ins stepped for real.

A call timed alone misses what a training step spends around it: autograd recording the call,
the backward engine scheduling it, Python. On the CPU that is tens of microseconds per call and
dominates small models, so :func:`call_overhead_s` measures it once per device (a chain of tiny
ops stepped for real) and the estimator adds it per call. On CUDA the host's work overlaps the
kernels (:func:`host_overlaps`): a call costs the longer of its kernel and the host's time per
call (:func:`host_floor_s`), which bounds small models (an H200 ran a 2-layer GPT's step in
5.7 ms, its kernels alone in 4.9 ms, and checkpointed plans 1.7-3.5x slower than their kernels,
2026-11-27). Likewise each checkpoint region costs its own bookkeeping (saved-tensor hooks, RNG
state, the recomputation's set-up): :func:`checkpoint_overhead` measures that once per device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.passes.cuda_timing import time_back_to_back
from planner.passes.offload import host_apart, offloaded_call
from planner.passes.op_call import OpCall, op_call
from planner.passes.timing_runs import clock

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
            alone[c.key] = time_back_to_back(c, device, 5)
    alone_s = [alone.get(c.key) or 0.0 if c is not None else 0.0 for c in recorder.calls]
    if host_overlaps(device):
        return host_floor_s(alone_s, step_s)
    return max(0.0, (step_s - sum(alone_s)) / len(recorder.calls))
