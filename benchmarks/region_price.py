"""What a checkpoint region's price is worth against a real step: the data behind
``overhead_fits.FILLER_WIDTH`` and the per-region bookkeeping the estimator charges.

    python -m benchmarks.region_price [--rounds 3]

GPT-ref-small's five layer norms and two GELUs, each its own region (little to recompute): the
stand-in's bookkeeping per region (``overhead_fits.checkpoint_overhead``, with a layer of work
between its regions) plus the recomputation, against what those regions add to the model's step,
measured (interleaved rounds, this process's CPU time, one thread). Prints one JSON line per
round with measured / predicted. Measured here: 0.8-1.2 mostly, 1.39 once in 15 runs, quiet or
with two busy loops on the two cores; with the stand-in's regions back to back (before
FILLER_WIDTH), 1.5-1.6; once, on the CI runner beside another test worker, 2.47 (BENCHMARKS.md:
step time). A measurement of the machine, so a benchmark and not a unit test (the unit tests
check the fit's arithmetic on steps timed by a fake, and that each region's figure is charged).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.models import gpt_ref_small_example

# GPT-ref-small's five layer norms and two GELUs: each its own region, little to recompute
CHEAP_OPS = ("layer_norm", "gelu")


def region_price_ratio() -> float:
    """What the regions add to the measured step over what the estimator prices them at."""
    from planner.measurement import time_step
    from planner.planning import price
    from planner.solvers.costgraph import Region, Schedule

    torch.manual_seed(0)
    model, example = gpt_ref_small_example()
    priced = price(model, example)  # the graph form
    graph = priced.graph
    cheap = [i for i, n in enumerate(graph.nodes) if n.op in CHEAP_OPS]
    assert len(cheap) == 7
    planned = priced.build(Schedule(tuple(Region(i, i + 1) for i in cheap), "hand"), 10**12)
    predicted_s = planned.predicted_step_time_s - graph.step_time_s
    rounds: dict[str, list[float]] = {"plain": [], "regions": []}
    for _ in range(30):
        for kind, module in (("plain", priced.module), ("regions", planned.module)):
            # this process's CPU time (one thread): other jobs on the machine stretch the
            # wall time of each step, not its work
            step = time_step(module, example, warmup=1, repeats=3, clock="cpu")
            rounds[kind].append(step.step_s)
    # the fastest round of each: other jobs only ever slow a round, and a busy machine's
    # context switches leave checkpoint's bookkeeping colder still (median 1.2-1.5 then)
    measured_s = min(rounds["regions"]) - min(rounds["plain"])
    return measured_s / predicted_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # timed by this process's CPU time: no thread waits on another
    try:
        for k in range(rounds):
            print(json.dumps({"round": k, "measured_over_predicted": region_price_ratio()}))
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
