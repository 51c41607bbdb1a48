"""Predicted vs measured step time, for every solver's plan at three budgets.

    python -m benchmarks.step_time [--models gpt-ref-small,llama] [--fractions 0.75,0.5,0.25]
                                   [--repeats 7] [--threads 1]
    python -m benchmarks.step_time --fit-batch gpt-ref-small [--cap-batch 8]

Each model is priced once on this machine's CPU (``planner.planning.price``: its own ops timed
here, ``passes/op_timing.py``); every solver plans it at each budget (a fraction of the way from
the least budget dp fits to the predicted eager peak). Every plan's training step is then timed
(``planner.measurement.time_step``), round-robin
across the plans (one timed step each per round, ``--repeats`` rounds) so that a busy machine
slows all of them alike, and the median is compared with ``Plan.predicted_step_time_s``.
Times on a shared machine are noisy; say so when you quote them.

``--fit-batch`` checks ``planner.fit_batch`` instead: the cap is the unmodified model's measured
peak at batch ``--cap-batch``; every batch size the sweep tries that fits is measured (peak and
step time) against its predicted peak and samples/s, and the pick against the measured best.
Each batch size is stepped as a training loop steps it: steps in a row until the share of CPU
time spent in the kernel has settled (on a CPU, page faults while glibc's heap settles: a fresh
GPT-ref eager batch-64 step spent 59% of its time there, its seventh 9%), then ``--repeats``
more, their median (``--interleaved``: the sizes in interleaved rounds instead, each step after
a warm-up of its own, so a busy machine slows all alike but every step meets a heap another
size left). Each row also gives its slowest and fastest step and that kernel share (the
prediction charges a share of the large blocks' faults, README: page faults).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import planner
from benchmarks.models import (
    gpt_example,
    gpt_ref_example,
    gpt_ref_for_batch,
    gpt_ref_small_example,
    gpt_ref_small_for_batch,
)
from planner.comparison import solver_names
from planner.measurement import time_step
from planner.planning import price
from planner.solvers.errors import InfeasibleBudgetError


def _llama():
    from tests.models_zoo import llama_example

    return llama_example()


def _sdpa():
    from benchmarks.models import GPTConfig

    return gpt_example(GPTConfig(n_layer=4, d_model=128, seq_len=128, attention="sdpa"), batch=4)


def _unet():
    from benchmarks.models import unet_example

    return unet_example(batch=2, size=32)


MODELS = {
    "gpt-ref-small": gpt_ref_small_example,
    "gpt-ref": gpt_ref_example,
    "llama": _llama,
    "sdpa": _sdpa,
    "unet": _unet,
}


def run(name: str, fractions: list[float], repeats: int) -> list[float]:
    """Print one model's table; return |predicted/measured - 1| of every plan."""
    model, example = MODELS[name]()
    t0 = time.perf_counter()
    priced = price(model, example)
    price_s = time.perf_counter() - t0
    plans = {}
    least_bytes = 0
    try:
        priced.solve(0, "dp")
    except InfeasibleBudgetError as e:
        least_bytes = e.min_bytes
    for fraction in fractions:
        # A fraction of the way from the least budget any plan fits to the eager peak.
        budget = int(least_bytes + fraction * (priced.eager_peak_bytes - least_bytes))
        for solver in solver_names():
            try:
                p = priced.plan(budget, solver)
            except (InfeasibleBudgetError, ValueError):
                continue
            plans[(solver, fraction)] = p
    samples: dict[tuple[str, float], list[float]] = {key: [] for key in plans}
    eager_samples: list[float] = []
    # Each round times every module once. A small model's step: one warm-up step first (the
    # previous module left the caches cold, which a training loop repeating one module never
    # sees), then the median of three; a large one's (over 0.2 s): one step.
    small = priced.graph.step_time_s < 0.2
    warmup, steps = (1, 3) if small else (0, 1)

    def timed_s(module: torch.nn.Module) -> float:
        return time_step(module, example, warmup=warmup, repeats=steps, clock=CLOCK).step_s

    for _ in range(repeats):
        # The captured graph without regions: what the plans' predictions start from.
        eager_samples.append(timed_s(priced.module))
        for key, p in plans.items():
            samples[key].append(timed_s(p.module))
    eager_s = statistics.median(eager_samples)
    print(
        f"\n## {name}: priced in {price_s:.1f} s ({priced.graph.meta.get('timing')}); "
        f"no regions: measured {eager_s * 1e3:.2f} ms, predicted "
        f"{priced.graph.step_time_s * 1e3:.2f} ms ({priced.graph.step_time_s / eager_s - 1:+.1%})\n"
    )
    print("| solver | budget | regions | predicted peak | predicted step | measured step | error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    errors = [abs(priced.graph.step_time_s / eager_s - 1)]
    for (solver, fraction), p in plans.items():
        measured_s = statistics.median(samples[(solver, fraction)])
        error = p.predicted_step_time_s / measured_s - 1
        errors.append(abs(error))
        print(
            f"| {solver if solver == p.solver else f'{solver} (chose {p.solver})'} "
            f"| {fraction:.0%} | {len(p.regions)} "
            f"| {p.predicted_peak_bytes / 2**20:.2f} MiB | {p.predicted_step_time_s * 1e3:.2f} ms "
            f"| {measured_s * 1e3:.2f} ms | {error:+.1%} |"
        )
    return errors


# time_step's clock: "wall", or "cpu" (this process's CPU time) on a machine others load
CLOCK = "wall"
# --fit-batch: measure each batch size settled, as a training loop runs it (else interleaved)
SETTLE = True
# A batch size has settled when its last three steps' kernel shares lie within this of each
# other, or after this many steps
SETTLED_SPREAD = 0.03
MAX_SETTLE_STEPS = 12

BATCH_FACTORIES = {"gpt-ref-small": gpt_ref_small_for_batch, "gpt-ref": gpt_ref_for_batch}


def check_fit_batch(name: str, cap_batch: int, repeats: int) -> None:
    factory = BATCH_FACTORIES[name]
    model, _ = factory(1)
    cap_bytes = planner.measure(model, factory(cap_batch)[1]).peak_bytes
    t0, cpu0 = time.perf_counter(), time.process_time()
    fit = planner.fit_batch(model, lambda b: factory(b)[1], cap_bytes / 1e9)
    print(
        f"fit_batch in {time.perf_counter() - t0:.1f} s wall ({time.process_time() - cpu0:.1f} s "
        f"CPU, load {os.getloadavg()[0]:.1f})"
    )
    print(fit)
    rows = [r for r in fit.rows if r.fits]
    # Each winner applied in place to a freshly built model, as a training script would.
    modules, inputs = {}, {}
    for r in rows:
        fresh, inputs[r.batch_size] = factory(r.batch_size)
        modules[r.batch_size] = fit.plans[r.batch_size].apply(fresh)
    peaks = {b: planner.measure(m, inputs[b]).peak_bytes for b, m in modules.items()}
    samples: dict[int, list[float]] = {b: [] for b in modules}
    # The share of CPU time in the kernel: mostly page faults (glibc maps a tensor of 32 MiB
    # or more afresh unless a free heap chunk fits), which vary run to run
    system: dict[int, list[float]] = {b: [0.0, 0.0] for b in modules}
    settled_after: dict[int, int] = {}

    def step(b: int) -> tuple[float, float, float]:
        before = os.times()
        step_s = time_step(modules[b], inputs[b], warmup=0, repeats=1, clock=CLOCK).step_s
        after = os.times()
        cpu_s = after.user - before.user + after.system - before.system
        return step_s, after.system - before.system, cpu_s

    def sample(b: int) -> None:
        step_s, kernel_s, cpu_s = step(b)
        samples[b].append(step_s)
        system[b][0] += kernel_s
        system[b][1] += cpu_s

    if SETTLE:
        # As a training loop runs one batch size: steps in a row until the kernel's share has
        # settled (GPT-ref's eager batch 64, fresh in a process, two processes: 59-60% on its
        # first step, 27-40% on its fourth, 7-9% from its seventh), then ``repeats`` steps,
        # their median
        for b in modules:
            shares = []
            while len(shares) < MAX_SETTLE_STEPS:
                _, kernel_s, cpu_s = step(b)
                shares.append(kernel_s / max(cpu_s, 1e-9))
                if len(shares) >= 3 and max(shares[-3:]) - min(shares[-3:]) <= SETTLED_SPREAD:
                    break
            settled_after[b] = len(shares)
            for _ in range(repeats):
                sample(b)
    else:
        for _ in range(repeats):
            for b in modules:
                step(b)  # a warm-up: the step before was another batch size's
                sample(b)
    how = (
        f"each batch size's steps in a row, settled after {settled_after} steps"
        if SETTLE
        else "interleaved rounds, each step after a warm-up of its own"
    )
    print(
        f"\n## fit_batch on {name}: cap = eager's measured peak at batch {cap_batch}, "
        f"{cap_bytes / 2**20:.2f} MiB; {how}\n"
    )
    print(
        "| batch | solver | predicted peak | measured peak | <= cap | predicted samples/s "
        "| measured samples/s (slowest-fastest step) | error | system time |"
    )
    print("|---:|---|---:|---:|---|---:|---:|---:|---:|")
    measured_rate = {}
    for r in rows:
        measured_rate[r.batch_size] = r.batch_size / statistics.median(samples[r.batch_size])
        error = r.samples_per_s / measured_rate[r.batch_size] - 1
        spread = f"{r.batch_size / max(samples[r.batch_size]):,.2f}-"
        spread += f"{r.batch_size / min(samples[r.batch_size]):,.2f}"
        kernel_s, cpu_s = system[r.batch_size]
        print(
            f"| {r.batch_size} | {r.solver} | {r.predicted_peak_bytes / 2**20:.2f} MiB "
            f"| {peaks[r.batch_size] / 2**20:.2f} MiB "
            f"| {'yes' if peaks[r.batch_size] <= cap_bytes else '**no**'} "
            f"| {r.samples_per_s:,.2f} | {measured_rate[r.batch_size]:,.2f} ({spread}) "
            f"| {error:+.1%} | {kernel_s / max(cpu_s, 1e-9):.0%} |"
        )
    best = max(measured_rate, key=measured_rate.get)
    ratio = measured_rate[fit.best_batch_size] / measured_rate[best]
    print(
        f"\npick: batch {fit.best_batch_size} ({measured_rate[fit.best_batch_size]:,.1f} "
        f"samples/s measured); measured best: batch {best} ({measured_rate[best]:,.1f}); "
        f"pick at {ratio:.1%} of the measured best"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-ref-small,llama")
    parser.add_argument("--fractions", default="0.75,0.5,0.25")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--fit-batch", choices=sorted(BATCH_FACTORIES), help="check fit_batch")
    parser.add_argument("--cap-batch", type=int, default=8, help="for --fit-batch")
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="for --fit-batch: time the batch sizes in interleaved rounds (each step after a "
        "warm-up of its own), not each settled in a row",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="measure steps by the wall clock or this process's CPU time (one thread, shared "
        "machine: what the calibration times by)",
    )
    args = parser.parse_args()
    global CLOCK, SETTLE
    CLOCK, SETTLE = args.clock, not args.interleaved
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = "settled steps in a row" if args.fit_batch and SETTLE else "interleaved steps"
    print(
        f"CPU, {torch.get_num_threads()} threads, median of {args.repeats} {steps}, "
        f"{args.clock} clock"
    )
    if args.fit_batch:
        check_fit_batch(args.fit_batch, args.cap_batch, args.repeats)
        return
    fractions = [float(f) for f in args.fractions.split(",")]
    errors: list[float] = []
    for name in args.models.split(","):
        errors += run(name, fractions, args.repeats)
    within = sum(e <= 0.10 for e in errors)
    worst = max(errors)
    print(f"\n{within} of {len(errors)} predictions within 10% of measured; worst {worst:.1%}")


if __name__ == "__main__":
    main()
