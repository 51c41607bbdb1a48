"""How close is the predicted peak to the measured one? Every reference model, many schedules.

    python -m benchmarks.estimator_accuracy [--models gpt-ref,cnn] [--solvers dp,uniform]
        [--fractions 0.1,0.4,0.7] [--png estimator_timeline.png] [--small]

For GPT-ref, a transformer on ``F.scaled_dot_product_attention``, the residual CNN, the U-Net
and the MLP: capture and estimate once, then for no checkpointing, checkpoint-every-block and
each solver's plan at three budgets between the least it reaches and the eager peak (labelled
as a percentage of the predicted eager peak), rewrite the module,
run one real step with ``planner.measure`` (CPU) and print predicted vs measured peak, and the
predicted vs measured step-time ratio over eager. Ends with the worst error, and plots GPT-ref's
predicted memory timeline against the measured one to a PNG.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.models import (
    GPT_REF_SMALL,
    GPTConfig,
    gpt_example,
    gpt_ref_example,
    gpt_ref_small_example,
    mlp_example,
    residual_cnn_example,
    unet_example,
)
from planner.measurement import Measurement, measure
from planner.planning import price
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import get_solver
from planner.solvers.simulate import Simulation, simulate

MIB = 2**20

MODELS: dict[str, Callable] = {
    "gpt-ref": gpt_ref_example,
    "gpt-sdpa": lambda: gpt_example(GPTConfig(attention="sdpa")),
    "cnn": residual_cnn_example,
    "unet": unet_example,
    "mlp": mlp_example,
}
# Small copies for the test that guards the accuracy (seconds, not minutes).
SMALL_MODELS: dict[str, Callable] = {
    "gpt-small": gpt_ref_small_example,
    "gpt-sdpa-small": lambda: gpt_example(
        GPTConfig(**{**GPT_REF_SMALL.__dict__, "attention": "sdpa"}), batch=2
    ),
    "cnn-small": lambda: residual_cnn_example(batch=2, size=16, n_blocks=3),
    "unet-small": lambda: unet_example(batch=2, size=32),
    "mlp-small": lambda: mlp_example(batch=64, width=128, depth=4, d_in=64),
}


@dataclass(frozen=True)
class Row:
    model: str
    schedule: str  # "none", "every-block", or "<solver> @ <fraction>"
    budget_bytes: int | None
    predicted_peak_bytes: int | None  # None: no schedule fits the budget
    measured_peak_bytes: int | None
    predicted_time_ratio: float | None = None
    measured_time_ratio: float | None = None
    regions: int = 0
    note: str = ""  # why a schedule was not measured

    @property
    def error(self) -> float | None:
        if not self.measured_peak_bytes or self.predicted_peak_bytes is None:
            return None
        return self.predicted_peak_bytes / self.measured_peak_bytes - 1


def step_time_s(graph: CostGraph, sim: Simulation) -> float:
    """Roofline time of one step: forward, backward and the schedule's recomputation."""
    base = sum(graph.node_time_s(i) + graph.node_time_s(i, True) for i in range(len(graph.nodes)))
    return base + sim.recompute_time_s


def accuracy_rows(
    name: str,
    make: Callable,
    solvers: list[str],
    fractions: list[float],
    repeats: int = 1,
) -> tuple[list[Row], dict]:
    """Predicted vs measured rows for one model; also returns what the timeline plot needs."""
    model, example = make()
    # The roofline with the CPU profile, as estimate prices a CPU model by default.
    priced = price(model, example, device="cpu")
    graph = priced.graph
    eager_sim = simulate(graph, Schedule())
    eager_time_s = step_time_s(graph, eager_sim)

    schedules: list[tuple[str, int | None, Schedule | None]] = [
        ("none", None, Schedule()),
        ("every-block", None, get_solver("uniform")(graph, math.inf)),
    ]
    for solver in solvers:
        solve = get_solver(solver)
        try:  # the least peak this solver reaches: budgets go between it and the eager peak
            least = simulate(graph, solve(graph, 0)).peak_bytes
        except InfeasibleBudgetError as e:
            least = e.min_bytes
        except Exception as e:  # noqa: BLE001 - a broken solver is a row, not a crash
            print(f"{name}: solver {solver} failed: {type(e).__name__}: {e}")
            continue
        for fraction in fractions:
            budget = int(least + fraction * max(0, eager_sim.peak_bytes - least))
            label = f"{solver} @ {budget / eager_sim.peak_bytes:.0%}"
            try:
                schedules.append((label, budget, solve(graph, budget)))
            except InfeasibleBudgetError:
                schedules.append((label, budget, None))
            except Exception as e:  # noqa: BLE001
                print(f"{name}: solver {solver} at {budget} B failed: {type(e).__name__}: {e}")

    rows: list[Row] = []
    eager_measured: Measurement | None = None
    extra: dict = {"graph": graph}
    for label, budget, schedule in schedules:
        if schedule is None:
            rows.append(Row(name, label, budget, None, None))
            continue
        sim = simulate(graph, schedule)
        try:
            module = priced.build(schedule, budget or 0).module
            measured = measure(module, example, repeats=repeats)
        except Exception as e:  # noqa: BLE001 - a failing rewrite is a row, not a crash
            note = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            rows.append(Row(name, label, budget, sim.peak_bytes, None, note=note))
            continue
        if label == "none":
            eager_measured = measured
        extra.setdefault("timelines", []).append((label, sim, measured))
        rows.append(
            Row(
                model=name,
                schedule=label,
                budget_bytes=budget,
                predicted_peak_bytes=sim.peak_bytes,
                measured_peak_bytes=measured.peak_bytes,
                predicted_time_ratio=step_time_s(graph, sim) / eager_time_s,
                measured_time_ratio=measured.step_time_s / eager_measured.step_time_s
                if eager_measured
                else None,
                regions=len(schedule.regions),
            )
        )
    return rows, extra


def format_table(rows: list[Row]) -> str:
    lines = [
        "| model | schedule | regions | budget | predicted peak | measured peak | error "
        "| time ratio pred / meas |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r.budget_bytes / MIB:.1f} MiB" if r.budget_bytes else "-"
        if r.predicted_peak_bytes is None:
            lines.append(f"| {r.model} | {r.schedule} | - | {budget} | infeasible | | | |")
            continue
        if r.measured_peak_bytes is None:
            lines.append(
                f"| {r.model} | {r.schedule} | | {budget} | {r.predicted_peak_bytes / MIB:.2f} MiB "
                f"| not run: {r.note} | | |"
            )
            continue
        times = (
            f"{r.predicted_time_ratio:.2f} / {r.measured_time_ratio:.2f}"
            if r.measured_time_ratio
            else ""
        )
        lines.append(
            f"| {r.model} | {r.schedule} | {r.regions} | {budget} "
            f"| {r.predicted_peak_bytes / MIB:.2f} MiB | {r.measured_peak_bytes / MIB:.2f} MiB "
            f"| {r.error:+.2%} | {times} |"
        )
    return "\n".join(lines)


def plot_timelines(
    timelines: list[tuple[str, Simulation, Measurement]], path: str, title: str
) -> None:
    """Predicted (simulate) vs measured (planner.measure) live bytes over one step, per schedule.

    The two timelines have different events (fx nodes vs aten ops), so each is drawn against
    its progress through forward (0..1) and backward, recomputation included (1..2).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def progress(events: list[tuple[str, int]], is_forward: Callable[[str], bool]):
        fwd = [b for e, b in events if is_forward(e)]
        bwd = [b for e, b in events if not is_forward(e)]
        xs = [i / max(1, len(fwd)) for i in range(len(fwd))]
        xs += [1 + i / max(1, len(bwd)) for i in range(len(bwd))]
        return xs, [b / MIB for b in fwd + bwd]

    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 3.6 * len(timelines)), squeeze=False)
    for ax, (label, sim, measured) in zip(axes[:, 0], timelines):
        xs, ys = progress(list(measured.timeline), lambda e: not e.startswith("backward"))
        ax.plot(xs, ys, label=f"measured (peak {measured.peak_bytes / MIB:.1f} MiB)", lw=1.2)
        xs, ys = progress(list(sim.timeline), lambda e: e.startswith("fwd"))
        ax.plot(xs, ys, "--", label=f"predicted (peak {sim.peak_bytes / MIB:.1f} MiB)", lw=1.2)
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_ylabel("live MiB above baseline")
        ax.set_title(f"{title}: {label}")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("progress through the step: forward 0..1, backward 1..2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--solvers", default="uniform,sqrt,greedy,revolve,selective,dp,ilp")
    parser.add_argument(
        "--fractions", default="0.1,0.4,0.7", help="budget = least + f * (eager - least)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--png", default="estimator_timeline.png")
    parser.add_argument("--small", action="store_true", help="the small copies (quick)")
    args = parser.parse_args()
    models = SMALL_MODELS if args.small else MODELS
    names = list(models) if args.small else args.models.split(",")
    solvers = [s for s in args.solvers.split(",") if s]
    fractions = [float(f) for f in args.fractions.split(",")]

    all_rows: list[Row] = []
    for name in names:
        t0 = time.perf_counter()
        rows, extra = accuracy_rows(name, models[name], solvers, fractions, args.repeats)
        all_rows += rows
        print(f"{name}: {len(rows)} schedules in {time.perf_counter() - t0:.0f} s", flush=True)
        for row in rows:
            print(format_table([row]).splitlines()[-1], flush=True)
        if name in ("gpt-ref", "gpt-small") and args.png:
            shown = [t for t in extra["timelines"] if t[0] in ("none", "every-block")]
            plot_timelines(shown, args.png, name)
            print(f"timeline plot: {args.png}")
    print()
    print(format_table(all_rows))
    errors = [abs(r.error) for r in all_rows if r.error is not None]
    print(
        f"\n{len(errors)} measured schedules; worst |error| {max(errors):.2%}, "
        f"mean {sum(errors) / len(errors):.2%}"
    )


if __name__ == "__main__":
    main()
