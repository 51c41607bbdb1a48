"""planner against the checkpointing people use today, on GPT-ref (CPU), all measured the same way.

Anchors: eager; ``torch.utils.checkpoint`` on every block by hand; ``checkpoint_sequential`` with
about sqrt(N) segments; selective activation checkpointing that saves matmul outputs; and
``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` at 0.5 and 0.2.
Then planner's rows: ``planner.plan`` with each anchor's measured peak as the budget (against
the torch.compile anchors, planner's module compiled with the same backend). Then
planner in place (``form="inplace"``, ``p.apply`` on a freshly built model: the model's own
modules wrapped, op-level policies) at SAC's measured peak and at compile 0.5's, each minimising
predicted time and, as a second row, recomputed FLOPs (``objective="flops"``); at 50% of eager,
with its predicted peak next to the measured one; and at eager's peak, where the plan has no
region and the applied model must step as fast as the untouched one. Every row's step time is the
median of steps interleaved in this one process (one step of each row in turn, ``--repeats``
rounds after a warm-up round), so machine noise hits them alike; planner's rows show their
predicted step time beside it, and the rows are ranked by measured time as well as FLOPs.

Every row is one ``planner.measure`` step (compiled rows via the profiler's allocation events,
since a dispatch-mode tracker makes dynamo run eager). Recompute FLOPs % is the step's FLOPs over
eager's minus one, counted by ``FlopCounterMode``'s formulas: on the eager step for hand-written
checkpointing, on the forward and backward graphs inductor actually compiles for torch.compile
(the anchors and planner's compiled rows alike).

    python -m benchmarks.vs_anchors            # GPT-ref, writes the BENCHMARKS.md section
    python -m benchmarks.vs_anchors --small    # GPT-ref-small smoke run, prints only
    python -m benchmarks.vs_anchors --inplace-only --repeats 5
        # only the in-place rows and the anchors they need (eager, SAC, compile 0.5); writes its
        # own BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from benchmarks.models import gpt_ref_example, gpt_ref_small_example
from planner.measurement import Measurement, measure
from planner.passes.step import call, training_loss

MiB = 2**20
BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
SECTION_START, SECTION_END = "<!-- vs_anchors:start -->", "<!-- vs_anchors:end -->"
INPLACE_START, INPLACE_END = "<!-- vs_anchors_inplace:start -->", "<!-- vs_anchors_inplace:end -->"
COMMAND = "python -m benchmarks.vs_anchors"
# matmul outputs: what selective checkpointing keeps (Linear on 3-D input is view + addmm/mm)
MATMUL_OPS = [torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default]

Example = Callable[[], tuple[nn.Module, Any]]


@dataclass(frozen=True)
class Row:
    name: str
    peak_bytes: int
    step_flops: int
    step_time_s: float
    setup_time_s: float  # planning, wrapping or compiling before the first step
    method: str  # how the peak was measured: "tracker" | "profiler" | "cuda"
    recompute_flops_pct: float = 0.0  # step FLOPs / eager step FLOPs - 1, in percent
    step_time_ratio: float = 1.0  # step time / eager step time
    note: str = ""
    saved_bytes: int = 0  # kept for backward at the end of forward
    predicted_bytes: int = 0  # planner's predicted peak (0: not a planner row)
    predicted_step_time_s: float = 0.0  # planner's predicted step time (0: not a planner row)
    regions: int = -1  # checkpoint regions of a planner row (-1: not a planner row)


# --- the anchors: each turns a fresh GPT into the module to measure -------------------------


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, context_fn: Callable | None = None) -> None:
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        # a Llama layer also takes the rotary tables: every argument goes through
        if self.context_fn is None:
            return checkpoint(self.block, *args, use_reentrant=False)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn)


class _Segmented(nn.Module):
    def __init__(self, blocks: nn.ModuleList, segments: int) -> None:
        super().__init__()
        self.blocks, self.segments = nn.Sequential(*blocks), segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's own: every segment but the last is checkpointed
        return checkpoint_sequential(self.blocks, self.segments, x, use_reentrant=False)


def block_list(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: GPT's ``blocks``, the Llama of ``plan_7b``'s ``layers``."""
    for name in ("blocks", "layers"):
        blocks = getattr(model, name, None)
        if isinstance(blocks, nn.ModuleList):
            return blocks
    raise ValueError(
        f"{type(model).__name__} has no nn.ModuleList named 'blocks' or 'layers' to checkpoint"
    )


def checkpoint_every_block(model: nn.Module) -> nn.Module:
    blocks = block_list(model)
    for i, block in enumerate(blocks):
        blocks[i] = _Checkpointed(block)
    return model


def checkpoint_sqrt_segments(model: nn.Module) -> nn.Module:
    segments = max(1, round(math.sqrt(len(model.blocks))))
    model.blocks = nn.ModuleList([_Segmented(model.blocks, segments)])
    return model


def selective_save_matmuls(model: nn.Module) -> nn.Module:
    context_fn = partial(create_selective_checkpoint_contexts, MATMUL_OPS)
    blocks = block_list(model)
    for i, block in enumerate(blocks):
        blocks[i] = _Checkpointed(block, context_fn)
    return model


HAND_ANCHORS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "checkpoint every block": checkpoint_every_block,
    "checkpoint_sequential sqrt(N)": checkpoint_sqrt_segments,
    "SAC, save matmuls": selective_save_matmuls,
}


# --- FLOPs -------------------------------------------------------------------------------------


def step_flops(module: nn.Module, example_input: Any) -> int:
    """FLOPs of one eager forward + loss + backward, recomputation included."""
    for p in module.parameters():
        p.grad = None
    with FlopCounterMode(display=False) as counter:
        training_loss(call(module, example_input)).backward()
    for p in module.parameters():
        p.grad = None
    return counter.get_total_flops()


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FlopCounterMode's formulas over an aten graph's nodes, shapes from their fake values."""
    total = 0
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        count = flop_registry.get(target.overloadpacket)
        if count is None:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        total += count(*args, **kwargs, out_val=node.meta.get("val"))
    return total


def compile_with_budget(
    model: nn.Module, example_input: Any, budget: float, backend: str = "inductor"
) -> tuple[nn.Module, float, int]:
    """torch.compile(model) with ``activation_memory_budget``, compiled by running one step.

    Returns the compiled module, the first step's wall time (compile included: the two do not
    separate) and the FLOPs of the forward and backward graphs handed to the compiler, where
    whatever the partitioner chose to recompute shows up. ``backend="aot_eager"`` partitions the
    same way (min-cut with inductor's decompositions and ranking, as torch's
    ``aot_eager_decomp_partition``) but runs the graphs eagerly: minutes faster to compile,
    without inductor's fusion, so its memory is not inductor's.
    """
    import torch._functorch.config as functorch_config
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner, select_decomp_table

    compiled_flops: list[int] = []

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        compiled_flops.append(graph_flops(gm))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def inductor_counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    def nop_counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiled_flops.append(graph_flops(gm))
        return make_boxed_func(gm.forward)

    aot_eager_counting = aot_autograd(
        fw_compiler=nop_counting,
        bw_compiler=nop_counting,
        decompositions=select_decomp_table(),
        partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"),
    )
    backends = {"inductor": inductor_counting, "aot_eager": aot_eager_counting}
    if backend not in backends:
        raise ValueError(f"backend must be one of {sorted(backends)}, got {backend!r}")

    def with_budget(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # The budget goes with the backend, not with the first call: dynamo recompiles a kept
        # module after any torch._dynamo.reset() (the next row's compile), and a budget patched
        # around the first step only would be back at 1.0 by then. The autograd cache would
        # skip partitioning and inner_compile, leaving nothing counted.
        with functorch_config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return backends[backend](gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=with_budget)
    start_s = time.perf_counter()
    training_loss(call(compiled, example_input)).backward()
    compile_s = time.perf_counter() - start_s
    for p in model.parameters():
        p.grad = None
    return compiled, compile_s, sum(compiled_flops)


# --- rows --------------------------------------------------------------------------------------


def _row(name: str, m: Measurement, flops: int, setup_s: float, note: str = "") -> Row:
    return Row(
        name,
        m.peak_bytes,
        flops,
        m.step_time_s,
        setup_s,
        m.method,
        note=note,
        saved_bytes=m.saved_bytes,
    )


def _planned_row(row: Row, plan: Any) -> Row:
    """``row`` with the plan's predicted peak and step time beside the measured ones."""
    return replace(
        row,
        predicted_bytes=plan.predicted_peak_bytes,
        predicted_step_time_s=plan.predicted_step_time_s,
    )


def _relative(rows: list[Row], eager: Row) -> list[Row]:
    return [
        replace(
            r,
            recompute_flops_pct=100.0 * (r.step_flops / eager.step_flops - 1.0),
            step_time_ratio=r.step_time_s / eager.step_time_s,
        )
        for r in rows
    ]


def anchor_rows(
    example: Example = gpt_ref_example,
    *,
    compile_budgets: tuple[float, ...] = (0.5, 0.2),
    compile_backend: str = "inductor",
    repeats: int = 1,
    hand_anchors: dict[str, Callable[[nn.Module], nn.Module]] = HAND_ANCHORS,
    keep: dict[str, nn.Module] | None = None,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Eager first, then every anchor, each on a fresh model with the same weights and input.

    ``keep``: when given, each row's module is stored in it by row name (for interleaved
    timing later)."""
    rows = []
    kept = {} if keep is None else keep
    model, x = example()
    flops = step_flops(model, x)  # doubles as the warmup step
    rows.append(_row("eager", measure(model, x, warmup=0, repeats=repeats), flops, 0.0))
    kept["eager"] = model
    log(f"eager: {rows[-1].peak_bytes / MiB:.1f} MiB")
    for name, wrap in hand_anchors.items():
        model, x = example()
        start_s = time.perf_counter()
        model = wrap(model)
        setup_s = time.perf_counter() - start_s
        flops = step_flops(model, x)
        rows.append(_row(name, measure(model, x, warmup=0, repeats=repeats), flops, setup_s))
        kept[name] = model
        log(f"{name}: {rows[-1].peak_bytes / MiB:.1f} MiB")
    for budget in compile_budgets:
        model, x = example()
        compiled, compile_s, flops = compile_with_budget(model, x, budget, compile_backend)
        m = measure(compiled, x, warmup=0, repeats=repeats)  # method "profiler" (compiled)
        name = compile_row_name(compile_backend, budget)
        rows.append(_row(name, m, flops, compile_s, note="time includes the first step"))
        kept[name] = compiled
        log(f"{name}: {rows[-1].peak_bytes / MiB:.1f} MiB")
    if keep is None:
        torch._dynamo.reset()
    return _relative(rows, rows[0])


def compile_row_name(backend: str, budget: float) -> str:
    return f"torch.compile ({backend}), activation_memory_budget={budget}"


def planner_rows(
    anchors: list[Row],
    example: Example = gpt_ref_example,
    *,
    solver: str = "auto",
    compile_backend: str = "inductor",
    repeats: int = 1,
    keep: dict[str, nn.Module] | None = None,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """planner.plan at each anchor's measured peak as the budget, measured like the anchors.
    Against a torch.compile anchor, planner's module is compiled with the same backend."""
    import planner

    eager = anchors[0]
    rows = []
    for anchor in anchors[1:]:
        model, x = example()
        name = f"planner ({solver}) at {anchor.name}'s peak"
        compiled = anchor.name.startswith("torch.compile")
        if compiled:
            name += f", compiled ({compile_backend})"
        start_s = time.perf_counter()
        try:
            plan = planner.plan(
                model, x, mem_budget_gb=anchor.peak_bytes / 1e9, solver=solver, form="graph"
            )
        except planner.PlannerError as e:  # infeasible budget, unsupported model: say so
            note = f"{type(e).__name__}: {e}"
            rows.append(Row(name, 0, 0, 0.0, time.perf_counter() - start_s, "-", note=note))
            log(f"{name}: {note}")
            continue
        plan_s = time.perf_counter() - start_s
        if compiled:
            # torch.compile(plan.module) as a user would (budget 1.0, torch's default), through
            # the anchors' backend, FLOPs counted on the graphs it compiles: inside a region
            # the partitioner keeps what the plan keeps and recomputes the rest
            module, compile_s, flops = compile_with_budget(plan.module, x, 1.0, compile_backend)
            plan_s += compile_s
        else:
            module, flops = plan.module, step_flops(plan.module, x)
        m = measure(module, x, warmup=0, repeats=repeats)
        note = f"solver {plan.solver}, predicted {plan.predicted_peak_bytes / MiB:.1f} MiB"
        row = _row(name, m, flops, plan_s, note=note)
        rows.append(replace(_planned_row(row, plan), regions=len(plan.regions)))
        if keep is not None:
            keep[name] = module
        log(f"{name}: {rows[-1].peak_bytes / MiB:.1f} MiB")
    return _relative(rows, eager)


# --- planner in place ---------------------------------------------------------------------------

SAC = "SAC, save matmuls"


@dataclass(frozen=True)
class InplaceTarget:
    """One in-place row: planner's plan at ``budget_bytes`` (an anchor's measured peak, half
    eager's, or eager's: no regions), minimising ``objective``, recomputing at most
    ``max_recompute_flops_pct`` percent of the step's FLOPs if given."""

    what: str
    budget_bytes: int
    objective: str = "time"
    max_recompute_flops_pct: float | None = None

    @property
    def least(self) -> str:
        """What the row minimises, as its name says it."""
        if self.max_recompute_flops_pct is None:
            return f"least {self.objective}"
        return f"least {self.objective}, recompute FLOPs <= {self.max_recompute_flops_pct:.1f}%"


EAGER_PEAK = "eager's peak"


def inplace_targets(anchors: list[Row], compile_backend: str) -> list[InplaceTarget]:
    """The in-place rows the issue holds planner to: at SAC's measured peak and compile 0.5's
    (each minimising predicted time, and recomputed FLOPs, the issue's own measure; at SAC's
    also the least time within SAC's recomputed FLOPs + 0.5 points, the issue's allowance), at
    half eager's peak, and at eager's peak, where the plan has no region and must cost
    nothing."""
    by_name = {r.name: r for r in anchors}
    peaks = [(f"{SAC}'s peak", by_name[SAC].peak_bytes)]
    compile_half = by_name.get(compile_row_name(compile_backend, 0.5))
    if compile_half is not None:
        peaks.append((f"{compile_half.name}'s peak", compile_half.peak_bytes))
    targets = [InplaceTarget(w, b, o) for w, b in peaks for o in ("time", "flops")]
    sac_cap_pct = max(0.0, by_name[SAC].recompute_flops_pct) + 0.5
    targets.insert(2, InplaceTarget(peaks[0][0], peaks[0][1], "time", sac_cap_pct))
    eager = anchors[0].peak_bytes
    return [*targets, InplaceTarget("50% of eager", eager // 2), InplaceTarget(EAGER_PEAK, eager)]


def inplace_rows(
    anchors: list[Row],
    example: Example = gpt_ref_example,
    *,
    compile_backend: str = "inductor",
    solver: str = "auto",
    repeats: int = 1,
    keep: dict[str, nn.Module] | None = None,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """planner.plan(form="inplace") at each target budget, applied to a freshly built model
    (what a training script does), measured like the anchors."""
    import planner

    rows = []
    for target in inplace_targets(anchors, compile_backend):
        model, x = example()
        name = f"planner in place ({solver}, {target.least}) at {target.what}"
        start_s = time.perf_counter()
        try:
            plan = planner.plan(
                model,
                x,
                target.budget_bytes / 1e9,
                solver=solver,
                form="inplace",
                objective=target.objective,
                max_recompute_flops_fraction=(
                    None
                    if target.max_recompute_flops_pct is None
                    else target.max_recompute_flops_pct / 100
                ),
            )
        except planner.PlannerError as e:
            note = f"{type(e).__name__}: {e}"
            rows.append(Row(name, 0, 0, 0.0, time.perf_counter() - start_s, "-", note=note))
            log(f"{name}: {note}")
            continue
        plan_s = time.perf_counter() - start_s
        fresh, x = example()
        plan.apply(fresh)
        flops = step_flops(fresh, x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = measure(fresh, x, warmup=0, repeats=repeats)
        diverged = [w for w in caught if "ran other operations" in str(w.message)]
        note = (
            f"solver {plan.solver}, {len(plan.regions)} regions, predicted step without regions "
            f"{plan.graph.step_time_s:.3f} s"
        )
        if diverged:
            note += f"; {len(diverged)} region(s) ran other ops than planned (full recompute)"
        row = _row(name, m, flops, plan_s, note=note)
        rows.append(replace(_planned_row(row, plan), regions=len(plan.regions)))
        if keep is not None:
            keep[name] = fresh
        log(
            f"{name}: {m.peak_bytes / MiB:.1f} MiB measured, "
            f"{plan.predicted_peak_bytes / MiB:.1f} MiB predicted"
        )
    return _relative(rows, anchors[0])


def interleaved_step_times(
    modules: dict[str, nn.Module], example_input: Any, rounds: int
) -> dict[str, float]:
    """Median step time of each module, one step of each in turn per round, after one warmup
    round: drifting machine load (other jobs on the cores) hits every module alike. Each round
    starts one module later, so no module always follows the same one (a step runs slower after
    some steps than after others: the allocator's and the caches' state). (No gc.collect()
    between steps: it evicts the caches, which a training loop never does.)"""
    times: dict[str, list[float]] = {name: [] for name in modules}
    names = list(modules)
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            module = modules[name]
            for p in module.parameters():
                p.grad = None
            _sync(module)
            start_s = time.perf_counter()
            training_loss(call(module, example_input)).backward()
            _sync(module)  # on CUDA, backward() returns before its kernels have run
            if r:
                times[name].append(time.perf_counter() - start_s)
    for module in modules.values():
        for p in module.parameters():
            p.grad = None
    return {name: statistics.median(ts) for name, ts in times.items()}


def _sync(module: nn.Module) -> None:
    device = next(module.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def with_interleaved_times(
    rows: list[Row], modules: dict[str, nn.Module], example_input: Any, rounds: int
) -> list[Row]:
    """Replace the step time of every row with a kept module by its interleaved median, and
    recompute every ratio against eager's."""
    timed = interleaved_step_times(modules, example_input, rounds)
    rows = [
        replace(r, step_time_s=timed[r.name], note=_timed_note(r.note, rounds))
        if r.name in timed
        else r
        for r in rows
    ]
    eager = rows[0]
    return [replace(r, step_time_ratio=r.step_time_s / eager.step_time_s) for r in rows]


def _timed_note(note: str, rounds: int) -> str:
    timed = f"time: median of {rounds} interleaved steps"
    return f"{note}; {timed}" if note else timed


def inplace_verdicts(anchors: list[Row], ours: list[Row], compile_backend: str) -> list[str]:
    """The issue's targets for the in-place rows, each line says met or **missed** and why."""
    by_name = {r.name: r for r in anchors}
    lines = []
    for target, row in zip(inplace_targets(anchors, compile_backend), ours):
        what, budget_bytes = f"{target.what} ({target.least})", target.budget_bytes
        if row.method == "-":
            lines.append(f"- at {what}: planner refused the budget ({row.note}): **missed**")
            continue
        fits = row.peak_bytes <= budget_bytes
        peak = f"measured {row.peak_bytes / MiB:.1f} MiB vs budget {budget_bytes / MiB:.1f} MiB"
        if target.what.startswith(SAC):
            sac = by_name[SAC]
            checks = {
                "peak": fits,
                "FLOPs": row.recompute_flops_pct <= sac.recompute_flops_pct + 0.5,
                "time": row.step_time_s <= sac.step_time_s,
            }
            detail = (
                f"{peak}; recompute FLOPs {row.recompute_flops_pct:+.1f}% vs SAC's "
                f"{sac.recompute_flops_pct:+.1f}% (+0.5 allowed); step time "
                f"{row.step_time_s:.3f} s vs SAC's {sac.step_time_s:.3f} s"
            )
        elif target.what.startswith("torch.compile"):
            anchor = by_name[target.what.removesuffix("'s peak")]
            checks = {
                "peak": fits,
                "FLOPs": row.recompute_flops_pct <= anchor.recompute_flops_pct,
            }
            detail = (
                f"{peak}; recompute FLOPs {row.recompute_flops_pct:+.1f}% vs compile's "
                f"{anchor.recompute_flops_pct:+.1f}%"
            )
        elif target.what == EAGER_PEAK:
            eager_s = anchors[0].step_time_s
            checks = {"no regions": row.regions == 0, "overhead": row.step_time_s <= 1.01 * eager_s}
            detail = (
                f"{row.regions} regions; step time {row.step_time_s:.3f} s vs the untouched "
                f"model's {eager_s:.3f} s ({row.step_time_s / eager_s - 1:+.1%}; 1% allowed)"
            )
        else:
            error = row.predicted_bytes / row.peak_bytes - 1.0
            checks = {"peak": fits, "prediction": abs(error) <= 0.01}
            detail = (
                f"{peak}; predicted {row.predicted_bytes / MiB:.2f} MiB, "
                f"{100 * error:+.2f}% off measured (1% allowed)"
            )
        missed = [k for k, ok in checks.items() if not ok]
        verdict = "met" if not missed else f"**missed** ({', '.join(missed)})"
        lines.append(f"- at {what}: {detail}: {verdict}")
    return lines


# --- output ------------------------------------------------------------------------------------


def to_markdown(rows: list[Row]) -> str:
    lines = [
        "| run | measured peak (MiB) | predicted peak (MiB) | saved for backward (MiB) "
        "| recompute FLOPs % | step time (s) | predicted step time (s) | step time ratio "
        "| plan/compile time (s) | measured by | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if r.peak_bytes == 0 and r.method == "-":
            lines.append(
                f"| {r.name} | — | — | — | — | — | — | — | {r.setup_time_s:.1f} | — | {r.note} |"
            )
            continue
        predicted = f"{r.predicted_bytes / MiB:.2f}" if r.predicted_bytes else "—"
        predicted_s = f"{r.predicted_step_time_s:.3f}" if r.predicted_step_time_s else "—"
        lines.append(
            f"| {r.name} | {r.peak_bytes / MiB:.2f} | {predicted} | {r.saved_bytes / MiB:.2f} "
            f"| {r.recompute_flops_pct:+.1f} | {r.step_time_s:.3f} | {predicted_s} "
            f"| {r.step_time_ratio:.2f} | {r.setup_time_s:.1f} | {r.method} | {r.note} |"
        )
    return "\n".join(lines)


def write_section(
    markdown: str,
    path: Path = BENCHMARKS_MD,
    markers: tuple[str, str] = (SECTION_START, SECTION_END),
) -> None:
    """Replace this script's section of BENCHMARKS.md (between its markers), or append it."""
    start, end = markers
    section = f"{start}\n{markdown}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def verdicts(anchors: list[Row], ours: list[Row]) -> list[str]:
    """One line per anchor: planner's recompute FLOPs and measured step time at that anchor's
    measured peak (its rows come in the anchors' order, eager excluded) against the anchor's
    own; the time target is 5% below the anchor's."""
    lines = []
    for anchor, row in zip(anchors[1:], ours):
        if row.method == "-":
            lines.append(f"- {anchor.name}: planner refused its peak as budget ({row.note})")
            continue
        fits = row.peak_bytes <= anchor.peak_bytes
        # the table's rounding: equal at one decimal counts as equal
        below = round(row.recompute_flops_pct, 1) <= round(anchor.recompute_flops_pct, 1)
        verdict = "at or below" if fits and below else "**above**"
        faster = row.step_time_s / anchor.step_time_s - 1.0
        time_verdict = "met" if fits and faster <= -0.05 else "**missed**"
        lines.append(
            f"- {anchor.name}: planner {row.recompute_flops_pct:+.1f}% at "
            f"{row.peak_bytes / MiB:.1f} MiB vs {anchor.recompute_flops_pct:+.1f}% at "
            f"{anchor.peak_bytes / MiB:.1f} MiB: {verdict}; step time {row.step_time_s:.3f} s "
            f"vs {anchor.step_time_s:.3f} s ({faster:+.1%}; 5% faster: {time_verdict})"
        )
    return lines


def ranked_by_time(rows: list[Row]) -> list[str]:
    """Every measured row, fastest step first, with its peak and recompute FLOPs."""
    measured = sorted((r for r in rows if r.method != "-"), key=lambda r: r.step_time_s)
    return [
        f"{k}. {r.name}: {r.step_time_s:.3f} s, {r.peak_bytes / MiB:.1f} MiB, "
        f"{r.recompute_flops_pct:+.1f}% FLOPs"
        for k, r in enumerate(measured, 1)
    ]


def report(
    rows: list[Row],
    eager_step_s: float,
    title: str,
    n_anchors: int | None = None,
    *,
    n_inplace: int = 0,
    command: str = COMMAND,
    inplace_lines: list[str] | None = None,
) -> str:
    """The section: how to regenerate it, the table and, when planner's rows follow the first
    ``n_anchors`` rows, a verdict per anchor; then the in-place targets when given (the last
    ``n_inplace`` rows are the in-place ones)."""
    anchors = rows[:n_anchors]
    ours = rows[n_anchors : len(rows) - n_inplace] if n_anchors else []
    summary = [
        "",
        "Planner against each anchor at equal measured peak, recompute FLOPs and step time:",
    ]
    summary += verdicts(anchors, ours)
    summary += ["", "Ranked by measured step time:", "", *ranked_by_time(rows)]
    targets = ["", "planner in place against the issue's targets:", *(inplace_lines or [])]
    return "\n".join(
        [
            f"## {title}",
            "",
            f"Regenerate: `{command}`. CPU ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads), torch {torch.__version__}. Peak = bytes above "
            "the step's starting baseline (parameter gradients count); eager step "
            f"{eager_step_s:.2f} s. Recompute FLOPs: step FLOPs over eager's, FlopCounterMode "
            "formulas (matmuls only: pointwise recompute is free by this count, not in time). "
            "`activation_memory_budget` bounds the bytes saved for backward, not the step's "
            "peak: inductor's backward graph may hold many recomputed tensors at once. Step "
            "time ratios need a quiet machine; other jobs sharing the cores skew them.",
            "",
            to_markdown(rows),
            *(summary if ours else []),
            *(targets if inplace_lines else []),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="GPT-ref-small; print, no file")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        choices=["inductor", "aot_eager"],
        help="aot_eager: same partitioner, no inductor codegen (minutes faster, unfused memory)",
    )
    parser.add_argument("--no-planner", action="store_true", help="skip planner's graph rows")
    parser.add_argument("--no-inplace", action="store_true", help="skip planner's in-place rows")
    parser.add_argument(
        "--inplace-only",
        action="store_true",
        help="only the in-place rows and the anchors they need (eager, SAC, compile 0.5); "
        "writes its own BENCHMARKS.md section",
    )
    parser.add_argument("--solver", default="auto", help="planner solver for its rows")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of interleaved steps (one step of every row each): step time is the median",
    )
    args = parser.parse_args(argv)
    if args.inplace_only and args.no_inplace:
        parser.error("--inplace-only and --no-inplace exclude each other")

    from planner.solvers.registry import get_solver

    get_solver(args.solver)  # an unknown solver fails now, not after the anchors' minutes
    example = gpt_ref_small_example if args.small else gpt_ref_example
    compile_budgets = (0.5,) if args.inplace_only else (0.5, 0.2)
    keep: dict[str, nn.Module] = {}
    rows = anchor_rows(
        example,
        compile_budgets=() if args.no_compile else compile_budgets,
        compile_backend=args.compile_backend,
        repeats=args.repeats,
        hand_anchors={SAC: HAND_ANCHORS[SAC]} if args.inplace_only else HAND_ANCHORS,
        keep=keep,
    )
    n_anchors = len(rows)
    if not (args.no_planner or args.inplace_only):
        rows += planner_rows(
            rows,
            example,
            solver=args.solver,
            compile_backend=args.compile_backend,
            repeats=args.repeats,
            keep=keep,
        )
    lines = None
    n_inplace = 0
    if not args.no_inplace:
        ours = inplace_rows(
            rows[:n_anchors],
            example,
            compile_backend=args.compile_backend,
            solver=args.solver,
            repeats=args.repeats,
            keep=keep,
        )
        n_inplace = len(ours)
        rows += ours
    # Every row's step time from the same interleaved rounds, so noise hits them alike.
    rows = with_interleaved_times(rows, keep, example()[1], args.repeats)
    if n_inplace:
        lines = inplace_verdicts(
            rows[:n_anchors], rows[len(rows) - n_inplace :], args.compile_backend
        )
    keep.clear()
    torch._dynamo.reset()

    command = COMMAND + (f" --inplace-only --repeats {args.repeats}" if args.inplace_only else "")
    if args.small:
        title = "GPT-ref-small vs the anchors"
    elif args.inplace_only:
        title = "GPT-ref: planner in place vs the anchors it is held to (CPU)"
    else:
        title = "GPT-ref vs the anchors (CPU)"
    markdown = report(
        rows,
        rows[0].step_time_s,
        title,
        n_anchors,
        n_inplace=n_inplace,
        command=command,
        inplace_lines=lines,
    )
    print(markdown)
    if not args.small:
        markers = (
            (INPLACE_START, INPLACE_END) if args.inplace_only else (SECTION_START, SECTION_END)
        )
        write_section(markdown, markers=markers)
        print(f"\nwrote {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
