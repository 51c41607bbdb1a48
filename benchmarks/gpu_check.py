"""Check planner's claims on one CUDA GPU and write one markdown report.

    python -m benchmarks.gpu_check --out report.md     # sized for 10 minutes on one H100

Sections, each measured on the device (``planner.measure``: the caching allocator's
statistics; compiled code through the profiler's allocation events):

1. **Roofline rates**: the device profile planner prices with (``planner/devices.py``: datasheet
   peaks derated to 60%) against what the device does: a bf16 matmul's FLOP/s, a device-memory
   copy's bandwidth, and pinned host <-> device copies (the offload link).
2. **Conformance, CUDA subset**: small float32 models (GPT-ref's architecture with explicit
   attention and dropout, plan_7b's Llama with SDPA, a residual CNN in the graph form) x budgets
   from the least feasible to eager x objectives time and flops x both forms. Every point:
   measured <= budget, the peak's error (predicted / measured - 1) and the step time's.
3. **Against the anchors** on a Llama-style model (plan_7b's, bf16, ~220M parameters, 4k
   tokens): eager, checkpoint every layer, SAC saving matmuls and torch.compile (inductor) with
   ``activation_memory_budget=0.5`` (``benchmarks/vs_anchors.py``'s anchors), then planner in
   place at each anchor's measured peak (compiled per layer against the compiled anchor), every
   row's step time from the same interleaved rounds, with the verdicts of vs_anchors.
4. **Offload**: on the same Llama, at a budget halfway between every layer's peak and eager's,
   whether planner chose to offload, and what the step measured; then every attention module
   offloaded by hand against the same modules recomputed (the 0.8 overlap the GPU profiles
   assume, against the time the copies measurably add).

Sections run in that order within ``--budget-s`` (a section that would not fit is skipped and
the report says so); the report is rewritten after each section, so a crash keeps what ran.
Without a CUDA device this exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

MiB = 2**20
PEAK_TOLERANCE = 0.01  # the "peak error <= 1%"
STEP_TOLERANCE = 0.10  # and "step-time error <= 10%"
NEEDS_CUDA = (
    "benchmarks.gpu_check needs a CUDA device (torch.cuda.is_available() is False); run it on a "
    "machine with an NVIDIA GPU and a CUDA build of torch"
)


# --- the rows the report is made of -----------------------------------------------------------


@dataclass(frozen=True)
class RateCheck:
    """One rate of the device profile against the device's own measurement (per second)."""

    what: str
    unit: str  # how the table prints it: "TFLOP/s" or "GB/s"
    profile_per_s: float
    measured_per_s: float


@dataclass(frozen=True)
class ConformancePoint:
    """One plan of the conformance sweep, measured. ``note`` set and ``measured_peak_bytes`` 0:
    planner refused the budget or the point failed (the note says how)."""

    model: str
    form: str
    objective: str
    budget_bytes: int
    predicted_peak_bytes: int = 0
    measured_peak_bytes: int = 0
    predicted_step_s: float = 0.0
    measured_step_s: float = 0.0
    solver: str = ""
    regions: int = 0
    note: str = ""
    # refused at a budget planner had stated as feasible: the least budget the refusal states
    restated_least_bytes: int = 0

    @property
    def ran(self) -> bool:
        return self.measured_peak_bytes > 0

    @property
    def fits(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def peak_error(self) -> float:
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1.0

    @property
    def step_error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0


@dataclass(frozen=True)
class OffloadCheck:
    """One offload-section step: a plan (or a hand-made schedule) and what it measured."""

    what: str
    regions: int
    offloaded: tuple[str, ...]  # module paths of the offload regions
    offloaded_bytes: int  # predicted bytes sent to host
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_step_s: float
    measured_step_s: float
    note: str = ""


# --- pure formatting (runs anywhere; tests/test_gpu_check.py) ---------------------------------


def _mib(nbytes: int) -> str:
    return f"{nbytes / MiB:,.2f}"


def _rate(value_per_s: float, unit: str) -> str:
    scale = {"TFLOP/s": 1e12, "GB/s": 1e9}[unit]
    return f"{value_per_s / scale:,.1f} {unit}"


def rates_table(checks: Sequence[RateCheck], profile_name: str) -> str:
    lines = [
        f"| rate | profile `{profile_name}` | measured | measured / profile |",
        "|---|---:|---:|---:|",
    ]
    for c in checks:
        lines.append(
            f"| {c.what} | {_rate(c.profile_per_s, c.unit)} | {_rate(c.measured_per_s, c.unit)} "
            f"| {c.measured_per_s / c.profile_per_s:.2f} |"
        )
    return "\n".join(lines)


def conformance_table(points: Sequence[ConformancePoint]) -> str:
    lines = [
        "| model | form | objective | budget (MiB) | predicted (MiB) | measured (MiB) "
        "| measured <= budget | peak error | predicted step (ms) | measured step (ms) "
        "| step error | solver, regions | note |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for p in points:
        head = f"| {p.model} | {p.form} | {p.objective} | {_mib(p.budget_bytes)} "
        if not p.ran:
            lines.append(head + f"| — | — | — | — | — | — | — | — | {p.note} |")
            continue
        lines.append(
            head + f"| {_mib(p.predicted_peak_bytes)} | {_mib(p.measured_peak_bytes)} "
            f"| {'yes' if p.fits else '**no**'} | {p.peak_error:+.2%} "
            f"| {1e3 * p.predicted_step_s:.2f} | {1e3 * p.measured_step_s:.2f} "
            f"| {p.step_error:+.1%} | {p.solver}, {p.regions} | {p.note} |"
        )
    return "\n".join(lines)


def conformance_verdicts(points: Sequence[ConformancePoint]) -> list[str]:
    """The issue's three targets over every measured point, each met or **missed**, with the
    worst point named."""
    ran = [p for p in points if p.ran]
    refused = len(points) - len(ran)
    if not ran:
        return [f"- no point measured ({refused} refused or failed)"]

    def where(p: ConformancePoint) -> str:
        return f"{p.model}, {p.form}, {p.objective}, budget {_mib(p.budget_bytes)} MiB"

    over = [p for p in ran if not p.fits]
    worst_peak = max(ran, key=lambda p: abs(p.peak_error))
    worst_step = max(ran, key=lambda p: abs(p.step_error))
    lines = [
        f"- {len(ran)} points measured, {refused} refused or failed",
        f"- measured <= budget: {len(ran) - len(over)} of {len(ran)}: "
        + ("met" if not over else f"**missed** ({'; '.join(where(p) for p in over)})"),
        f"- worst peak error {worst_peak.peak_error:+.2%} ({where(worst_peak)}): "
        + ("met" if abs(worst_peak.peak_error) <= PEAK_TOLERANCE else "**missed**")
        + f" (<= {PEAK_TOLERANCE:.0%})",
        f"- worst step-time error {worst_step.step_error:+.1%} ({where(worst_step)}): "
        + ("met" if abs(worst_step.step_error) <= STEP_TOLERANCE else "**missed**")
        + f" (<= {STEP_TOLERANCE:.0%})",
    ]
    return lines


def offload_table(checks: Sequence[OffloadCheck]) -> str:
    lines = [
        "| step | regions | offloaded | sent to host, predicted (MiB) | predicted peak (MiB) "
        "| measured peak (MiB) | peak error | predicted step (ms) | measured step (ms) "
        "| step error | note |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in checks:
        offloaded = ", ".join(c.offloaded) if c.offloaded else "none"
        peak_error = c.predicted_peak_bytes / c.measured_peak_bytes - 1.0
        step_error = c.predicted_step_s / c.measured_step_s - 1.0
        lines.append(
            f"| {c.what} | {c.regions} | {offloaded} | {_mib(c.offloaded_bytes)} "
            f"| {_mib(c.predicted_peak_bytes)} | {_mib(c.measured_peak_bytes)} "
            f"| {peak_error:+.2%} | {1e3 * c.predicted_step_s:.1f} "
            f"| {1e3 * c.measured_step_s:.1f} | {step_error:+.1%} | {c.note} |"
        )
    return "\n".join(lines)


def render(title: str, preamble: Sequence[str], sections: Sequence[tuple[str, str]]) -> str:
    """The whole report: a title, lines about the device and run, then each section."""
    parts = [f"# {title}", "", *preamble]
    for heading, body in sections:
        parts += ["", f"## {heading}", "", body.rstrip("\n")]
    return "\n".join(parts) + "\n"


# --- measuring (CUDA; each function takes the device, so it can be tried on the CPU) ----------


def _best_s(fn: Callable[[], Any], device: torch.device, repeats: int = 10) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start_s = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start_s)
    return min(times)


def measure_rates(device: torch.device, n: int = 8192, copy_mib: int = 1024) -> list[RateCheck]:
    """The profile's roofline rates against a bf16 matmul, a device copy and pinned host
    copies measured on ``device``."""
    from planner.devices import profile_of

    profile = profile_of(device)
    checks = []
    with torch.no_grad():
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        matmul_s = _best_s(lambda: a @ a, device)
        checks.append(
            RateCheck(f"matmul, bf16, {n}^3", "TFLOP/s", profile.flops_per_s, 2 * n**3 / matmul_s)
        )
        x = torch.empty(copy_mib * MiB, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        copy_s = _best_s(lambda: y.copy_(x), device)
        # a copy reads and writes every byte: the roofline's bytes moved
        checks.append(
            RateCheck("device memory copy", "GB/s", profile.bytes_per_s, 2 * x.numel() / copy_s)
        )
        if device.type == "cuda":
            host = torch.empty(x.numel(), dtype=torch.uint8, pin_memory=True)
            h2d_s = _best_s(lambda: x.copy_(host, non_blocking=True), device)
            d2h_s = _best_s(lambda: host.copy_(x, non_blocking=True), device)
            checks.append(
                RateCheck(
                    "host -> device, pinned", "GB/s", profile.host_bytes_per_s, x.numel() / h2d_s
                )
            )
            checks.append(
                RateCheck(
                    "device -> host, pinned", "GB/s", profile.host_bytes_per_s, x.numel() / d2h_s
                )
            )
    return checks


def _to(value: Any, device: torch.device) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def conformance_models(
    device: torch.device,
) -> dict[str, tuple[Callable[[], Any], tuple[str, ...]]]:
    """name -> (factory of a fresh (model, example) on ``device``, the forms to plan)."""
    from benchmarks.models import GPTConfig, gpt_example, residual_cnn_example
    from benchmarks.plan_7b import LlamaConfig, llama_example

    # Activations of hundreds of KiB: the caching allocator's 512-byte rounding, which the
    # memory model does not price, stays far below 1% of the peak.
    gpt_cfg = GPTConfig(n_layer=2, d_model=128, n_head=4, seq_len=256, vocab_size=256)
    llama_cfg = LlamaConfig(
        n_layer=2, d_model=128, n_head=4, d_ff=352, vocab_size=256, seq_len=256, batch=4,
        dtype=torch.float32, attention="sdpa",
    )  # fmt: skip

    def gpt() -> Any:
        model, example = gpt_example(gpt_cfg, batch=4)
        return model.to(device), _to(example, device)

    def llama() -> Any:
        torch.manual_seed(0)
        model, _ = llama_example(llama_cfg, device="cpu")
        g = torch.Generator().manual_seed(1)
        shape = (llama_cfg.batch, llama_cfg.seq_len)
        tokens = [torch.randint(0, llama_cfg.vocab_size, shape, generator=g) for _ in "it"]
        return model.to(device), _to(tuple(tokens), device)

    def cnn() -> Any:
        model, x = residual_cnn_example(batch=16, size=32)
        return model.to(device), x.to(device)

    return {
        "gpt (explicit attention, dropout)": (gpt, ("inplace", "graph")),
        "llama (sdpa)": (llama, ("inplace", "graph")),
        # BatchNorm modules are never in-place regions: the graph form only
        "residual cnn (BatchNorm)": (cnn, ("graph",)),
    }


def _carried_out(plan: Any, factory: Callable[[], Any]) -> tuple[torch.nn.Module, Any]:
    """What runs the plan: a fresh model with the plan applied, or the plan's GraphModule."""
    if plan.form == "inplace":
        fresh, x = factory()
        return plan.apply(fresh), x
    return plan.module, None


def conformance_sweep(
    device: torch.device,
    *,
    fractions: Sequence[float] = (0.0, 1 / 3, 2 / 3, 1.0),
    objectives: Sequence[str] = ("time", "flops"),
    deadline_s: float = math.inf,
    time_limit_s: float = 10.0,
    log: Callable[[str], None] = print,
) -> list[ConformancePoint]:
    """Every model x form x budget (``fractions`` of the way from the least feasible budget to
    the measured eager peak) x objective, planned, carried out and measured. Points past
    ``deadline_s`` (``time.perf_counter()``) are listed as not run."""
    import planner

    points = []
    for name, (factory, forms) in conformance_models(device).items():
        model, x = factory()
        eager = planner.measure(model, x)
        for form in forms:
            budgets = _budgets(model, x, form, eager.peak_bytes, fractions)
            if isinstance(budgets, str):
                points.append(ConformancePoint(name, form, "-", 0, note=budgets))
                continue
            for budget_bytes in budgets:
                for objective in objectives:
                    point = ConformancePoint(name, form, objective, budget_bytes)
                    if time.perf_counter() > deadline_s:
                        points.append(replace(point, note="not run: out of time"))
                        continue
                    points.append(_conformance_point(point, factory, time_limit_s))
                    log(_point_line(points[-1]))
                    restated = points[-1].restated_least_bytes
                    if restated:  # the least budget a 1-byte plan stated was refused: try
                        # the one this refusal states, and keep both rows
                        again = replace(point, budget_bytes=restated + 1)
                        points.append(_conformance_point(again, factory, time_limit_s))
                        log(_point_line(points[-1]))
    return points


def _budgets(
    model: torch.nn.Module, x: Any, form: str, eager_bytes: int, fractions: Sequence[float]
) -> list[int] | str:
    import planner

    try:
        planner.plan(model, x, 1e-9, form=form)
        return "a 1-byte budget was accepted"  # nothing to sweep: say so in the table
    except planner.InfeasibleBudgetError as e:
        least_bytes = e.min_bytes + 1  # plan() rounds GB to bytes; +1 keeps it feasible
    except planner.PlannerError as e:
        return f"{type(e).__name__}: {e}"
    if least_bytes >= eager_bytes:
        return [least_bytes]
    return sorted({round(least_bytes + f * (eager_bytes - least_bytes)) for f in fractions})


def _conformance_point(
    point: ConformancePoint, factory: Callable[[], Any], time_limit_s: float
) -> ConformancePoint:
    import planner

    model, x = factory()
    try:
        p = planner.plan(
            model,
            x,
            point.budget_bytes / 1e9,
            form=point.form,
            objective=point.objective,
            time_limit_s=time_limit_s,
        )
        module, fresh_x = _carried_out(p, factory)
        m = planner.measure(module, x if fresh_x is None else fresh_x, repeats=5)
    except Exception as e:  # a refusal or a failure is the point's answer, not the sweep's end
        point = replace(point, note=f"{type(e).__name__}: {str(e)[:200]}")
        least_bytes = getattr(e, "min_bytes", None)
        if isinstance(e, planner.InfeasibleBudgetError) and least_bytes > point.budget_bytes:
            point = replace(point, restated_least_bytes=least_bytes)
        return point
    return replace(
        point,
        predicted_peak_bytes=p.predicted_peak_bytes,
        measured_peak_bytes=m.peak_bytes,
        predicted_step_s=p.predicted_step_time_s,
        measured_step_s=m.step_time_s,
        solver=p.solver,
        regions=len(p.regions),
        note=", ".join(
            f"{n} {kind}" for kind, n in sorted(Counter(r.kind for r in p.regions).items())
        ),
    )


def _point_line(p: ConformancePoint) -> str:
    if not p.ran:
        return f"{p.model} {p.form} {p.objective} {_mib(p.budget_bytes)} MiB: {p.note}"
    return (
        f"{p.model} {p.form} {p.objective} {_mib(p.budget_bytes)} MiB: measured "
        f"{_mib(p.measured_peak_bytes)} MiB ({p.peak_error:+.2%} predicted), step "
        f"{1e3 * p.measured_step_s:.2f} ms ({p.step_error:+.1%} predicted)"
    )


# --- the Llama-style model against the anchors ---------------------------------------------------


def llama_config(layers: int = 12, seq_len: int = 4096, batch: int = 1) -> Any:
    """plan_7b's Llama at about 220M parameters: width 1024, 16 heads, SwiGLU 2816, vocabulary
    32000, bf16, SDPA core attention (flash on an H100)."""
    from benchmarks.plan_7b import LlamaConfig

    return LlamaConfig(
        n_layer=layers, d_model=1024, n_head=16, d_ff=2816, vocab_size=32000,
        seq_len=seq_len, batch=batch, dtype=torch.bfloat16, attention="sdpa",
    )  # fmt: skip


def llama_factory(cfg: Any, device: torch.device) -> Callable[[], tuple[torch.nn.Module, Any]]:
    """Fresh models with the same weights and tokens on every call (the anchors' contract)."""
    from benchmarks.plan_7b import llama_example

    def example() -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        model, _ = llama_example(cfg, device=str(device))
        g = torch.Generator(device=device).manual_seed(1)
        shape = (cfg.batch, cfg.seq_len)
        idx = torch.randint(0, cfg.vocab_size, shape, device=device, generator=g)
        targets = torch.randint(0, cfg.vocab_size, shape, device=device, generator=g)
        return model, (idx, targets)

    return example


def anchors_section(
    example: Callable[[], tuple[torch.nn.Module, Any]],
    *,
    compile_budgets: tuple[float, ...] = (0.5,),
    rounds: int = 5,
    time_limit_s: float = 30.0,
    log: Callable[[str], None] = print,
) -> tuple[list[Any], list[Any]]:
    """(anchor rows, planner rows) with interleaved step times; planner's rows in the anchors'
    order (eager excluded), as ``vs_anchors.verdicts`` reads them."""
    from benchmarks import vs_anchors as va

    keep: dict[str, torch.nn.Module] = {}
    hand = {
        "checkpoint every block": va.checkpoint_every_block,
        va.SAC: va.selective_save_matmuls,
    }
    anchors = va.anchor_rows(
        example,
        compile_budgets=compile_budgets,
        compile_backend="inductor",
        repeats=3,
        hand_anchors=hand,
        keep=keep,
        log=log,
    )
    ours = [
        _planner_at(anchor, anchors[0], example, time_limit_s, keep, log) for anchor in anchors[1:]
    ]
    rows = va.with_interleaved_times([*anchors, *ours], keep, example()[1], rounds)
    keep.clear()
    torch._dynamo.reset()
    return rows[: len(anchors)], rows[len(anchors) :]


def _planner_at(
    anchor: Any,
    eager: Any,
    example: Callable[[], tuple[torch.nn.Module, Any]],
    time_limit_s: float,
    keep: dict[str, torch.nn.Module],
    log: Callable[[str], None],
) -> Any:
    """planner in place at ``anchor``'s measured peak, applied to a fresh model; compiled per
    layer (inductor) when the anchor is torch.compile."""
    import planner
    from benchmarks import vs_anchors as va
    from planner.measurement import measure

    compiled = anchor.name.startswith("torch.compile")
    name = f"planner in place at {anchor.name}'s peak" + (
        ", compiled per layer" if compiled else ""
    )
    model, x = example()
    start_s = time.perf_counter()
    try:
        p = planner.plan(
            model, x, anchor.peak_bytes / 1e9, form="inplace", time_limit_s=time_limit_s
        )
    except planner.PlannerError as e:
        note = f"{type(e).__name__}: {e}"
        log(f"{name}: {note}")
        return va.Row(name, 0, 0, 0.0, time.perf_counter() - start_s, "-", note=note)
    del model
    fresh, x = example()
    p.apply(fresh)
    flops = va.step_flops(fresh, x)  # eager FLOPs: a dispatch mode makes dynamo run eager
    if compiled:
        for layer in va.block_list(fresh):
            layer.compile()
    setup_s = time.perf_counter() - start_s
    m = measure(fresh, x, warmup=1, repeats=3, method="profiler" if compiled else "auto")
    offloaded = sum(r.kind == "offload" for r in p.regions)
    note = f"solver {p.solver}, {len(p.regions)} regions ({offloaded} offload)"
    if compiled:
        note += "; FLOPs of the eager step"
    keep[name] = fresh
    log(
        f"{name}: {m.peak_bytes / MiB:.1f} MiB measured, "
        f"{p.predicted_peak_bytes / MiB:.1f} predicted"
    )
    return va.Row(
        name,
        m.peak_bytes,
        flops,
        m.step_time_s,
        setup_s,
        m.method,
        recompute_flops_pct=100.0 * (flops / eager.step_flops - 1.0),
        note=note,
        saved_bytes=m.saved_bytes,
        predicted_bytes=p.predicted_peak_bytes,
        predicted_step_time_s=p.predicted_step_time_s,
        regions=len(p.regions),
    )


def anchors_markdown(anchors: list[Any], ours: list[Any]) -> str:
    """The table (vs_anchors' columns), the verdict per anchor, the ranking by measured time,
    and planner's predicted peak and step time against its measured ones."""
    from benchmarks import vs_anchors as va

    lines = [va.to_markdown([*anchors, *ours]), "", "Planner at each anchor's measured peak:"]
    lines += va.verdicts(anchors, ours)
    lines += ["", "Ranked by measured step time:", "", *va.ranked_by_time([*anchors, *ours])]
    lines += ["", "planner's predictions against its measurements:"]
    for r in ours:
        if r.method == "-":
            continue
        lines.append(
            f"- {r.name}: peak {r.predicted_bytes / r.peak_bytes - 1:+.2%}, step time "
            f"{r.predicted_step_time_s / r.step_time_s - 1:+.1%} (predicted / measured - 1)"
        )
    return "\n".join(lines)


# --- offload -------------------------------------------------------------------------------------


def offload_section(
    example: Callable[[], tuple[torch.nn.Module, Any]],
    budget_bytes: int,
    *,
    time_limit_s: float = 30.0,
    log: Callable[[str], None] = print,
) -> list[OffloadCheck]:
    """planner's choice at ``budget_bytes``, the same without offload when it chose some, then
    by hand: no regions, every attention module offloaded, and the same modules recomputed."""
    import planner
    from planner.inplace_form import build_inplace_plan, price_inplace
    from planner.solvers.costgraph import Region, Schedule

    checks = []
    model, x = example()
    chosen = planner.plan(model, x, budget_bytes / 1e9, form="inplace", time_limit_s=time_limit_s)
    checks.append(_offload_check("planner at the budget", chosen, example))
    log(_offload_line(checks[-1]))
    if any(r.kind == "offload" for r in chosen.regions):
        no_offload = {"dp": {"offload": False}, "ilp": {"offload": False}}
        plain = planner.plan(
            model, x, budget_bytes / 1e9, form="inplace", time_limit_s=time_limit_s, **no_offload
        )
        checks.append(_offload_check("planner at the budget, offload off", plain, example))
        log(_offload_line(checks[-1]))
    eg = price_inplace(model, x)
    attention = [span for span, path in sorted(eg.spans.items()) if path.endswith(".self_attn")]
    # the step without regions first: what the copies add to it, against what the model
    # predicts they add (the transfer the overlap leaves exposed)
    for kind in ("none", "offload", "recompute"):
        regions = () if kind == "none" else (Region(*s, 0, kind) for s in attention)
        p = build_inplace_plan(model, eg, Schedule(tuple(regions), "manual"), 10**15)
        what = "no regions" if kind == "none" else f"every self_attn, {kind}"
        checks.append(_offload_check(what, p, example))
        log(_offload_line(checks[-1]))
    return checks


def _offload_check(what: str, p: Any, example: Callable[[], Any]) -> OffloadCheck:
    from planner.measurement import measure

    fresh, x = example()
    m = measure(p.apply(fresh), x, repeats=5)
    offloaded = tuple(r.name for r in p.regions if r.kind == "offload")
    sim = p.simulation
    note = f"solver {p.solver}" + (
        f"; predicted transfer exposed {1e3 * sim.offload_time_s:.1f} ms" if offloaded else ""
    )
    return OffloadCheck(
        what,
        len(p.regions),
        offloaded,
        sim.offload_bytes,
        p.predicted_peak_bytes,
        m.peak_bytes,
        p.predicted_step_time_s,
        m.step_time_s,
        note,
    )


def _offload_line(c: OffloadCheck) -> str:
    return (
        f"{c.what}: {len(c.offloaded)} offloaded, measured {_mib(c.measured_peak_bytes)} MiB "
        f"(predicted {_mib(c.predicted_peak_bytes)}), step {1e3 * c.measured_step_s:.1f} ms "
        f"(predicted {1e3 * c.predicted_step_s:.1f})"
    )


# --- the command --------------------------------------------------------------------------------


@dataclass
class _Report:
    path: Path
    preamble: list[str]
    sections: list[tuple[str, str]]
    failed: int = 0

    def add(self, heading: str, body: str) -> None:
        self.sections.append((heading, body))
        self.write()

    def write(self) -> None:
        text = render("planner on a GPU: gpu_check", self.preamble, self.sections)
        self.path.write_text(text)


def _run(report: _Report, heading: str, body: Callable[[], str]) -> None:
    """One section; a failure is written into the report (its traceback's tail) and the next
    section still runs."""
    start_s = time.perf_counter()
    try:
        text = body()
    except Exception:
        report.failed += 1
        tail = traceback.format_exc().strip().splitlines()[-12:]
        text = "**failed**:\n\n```\n" + "\n".join(tail) + "\n```"
    report.add(heading, text + f"\n\n(section wall time {time.perf_counter() - start_s:.0f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.md", help="the markdown report to write")
    parser.add_argument(
        "--budget-s", type=float, default=540.0, help="wall time for all sections (seconds)"
    )
    parser.add_argument("--layers", type=int, default=12, help="layers of the Llama-style model")
    parser.add_argument("--seq", type=int, default=4096, help="its sequence length (tokens)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA, file=sys.stderr)
        raise SystemExit(2)

    device = torch.device("cuda")
    start_s = time.perf_counter()
    deadline_s = start_s + args.budget_s
    from planner.devices import profile_of

    profile = profile_of(device)
    cfg = llama_config(args.layers, args.seq)
    example = llama_factory(cfg, device)
    report = _Report(
        Path(args.out),
        [
            f"Device: {torch.cuda.get_device_name(device)}; profile `{profile.name}`; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}. Command: "
            f"`python -m benchmarks.gpu_check {' '.join(argv or sys.argv[1:])}`.",
            "",
            "Peaks are bytes allocated above the step's starting baseline (the caching "
            "allocator's statistics; compiled rows: the profiler's allocation events). "
            "Errors are predicted / measured - 1.",
        ],
        [],
    )

    def rates() -> str:
        checks = measure_rates(device)
        return rates_table(checks, profile.name) + (
            "\n\nThe profile's rates are datasheet peaks x 0.6 (planner/devices.py); a measured "
            "/ profile ratio far from 1 means plans on this device price time off by as much."
        )

    def conformance() -> str:
        # a third of what is left; the anchors and offload need the rest
        budget_s = (deadline_s - time.perf_counter()) / 3
        points = conformance_sweep(device, deadline_s=time.perf_counter() + budget_s)
        return "\n".join([conformance_table(points), "", *conformance_verdicts(points)])

    anchors: list[Any] = []

    def vs_anchors() -> str:
        left_s = deadline_s - time.perf_counter()
        compile_budgets = () if args.no_compile or left_s < 300 else (0.5,)
        found = anchors_section(example, compile_budgets=compile_budgets)
        anchors.extend(found[0])
        n_params = sum(p.numel() for p in example()[0].parameters())
        head = (
            f"plan_7b's Llama, {cfg.n_layer} layers, width {cfg.d_model}, "
            f"{n_params / 1e6:.0f}M parameters, bf16, batch {cfg.batch} x {cfg.seq_len} tokens."
        )
        if not compile_budgets:
            head += " torch.compile rows skipped (--no-compile, or under 300 s left)."
        return head + "\n\n" + anchors_markdown(*found)

    def offload() -> str:
        by_name = {r.name: r for r in anchors}
        every, eager = by_name.get("checkpoint every block"), by_name.get("eager")
        if every is None or eager is None:
            return "not run: needs the anchors' measured peaks (that section did not finish)"
        budget_bytes = (every.peak_bytes + eager.peak_bytes) // 2
        checks = offload_section(example, budget_bytes)
        chosen = checks[0]
        verdict = (
            f"planner offloaded {', '.join(chosen.offloaded)}"
            if chosen.offloaded
            else "planner chose no offload"
        )
        return (
            f"Budget {_mib(budget_bytes)} MiB, halfway between every layer's measured peak and "
            f"eager's: {verdict}.\n\n" + offload_table(checks)
        )

    sections = [
        ("Roofline rates: the device profile against the device", rates, 30),
        ("Conformance, CUDA subset: measured <= budget, and the errors", conformance, 120),
        ("A Llama-style model against the anchors at their measured peaks", vs_anchors, 200),
        ("Offload, chosen or not, and what it measured", offload, 60),
    ]
    for heading, body, needs_s in sections:
        if deadline_s - time.perf_counter() < needs_s:
            report.add(heading, f"not run: under {needs_s} s of --budget-s left")
            continue
        _run(report, heading, body)
    print(f"wrote {report.path} in {time.perf_counter() - start_s:.0f} s")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
