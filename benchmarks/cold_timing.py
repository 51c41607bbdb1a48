"""What timing a CPU call on data evicted from the caches is worth: the data behind
``cpu_timing.cold_cpu_times``.

    python -m benchmarks.cold_timing [--rounds 5]

A memory-bound add on 32 x 1024 floats (128 KiB: its inputs and output stay in the core's L2
cache) timed hot (back to back, ``cuda_timing.stretch_s``) and cold (``op_timing.time_call``,
each run after an eviction of the caches), on one thread, by this process's CPU time. Prints
one JSON line per round with both figures and their ratio: cold over hot was 2-3.7x on the
2-core CI machine, 6.6-7.2x in 3 rounds on another 2-core machine. A measurement of the
machine, so a benchmark and not a unit test (the unit test checks the order of evictions and
runs with a fake clock).
"""

from __future__ import annotations

import argparse
import json

import torch

from planner.passes import op_timing
from planner.passes.cuda_timing import stretch_s
from planner.passes.op_call import op_call, real_arguments


def cold_and_hot_s() -> tuple[float, float]:
    """One round: (cold, hot) seconds per call of the add."""
    cpu = torch.device("cpu")
    x = torch.randn(32, 1024)
    add = op_call(torch.ops.aten.add.Tensor, (x, x), {})
    assert add is not None
    args, kwargs = real_arguments(add, cpu)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # timed by this process's CPU time: a busy other core moves it less
    try:
        hot_s = stretch_s(lambda: add.op(*args, **kwargs), cpu, 5)
        cold_s = op_timing.time_call(add, cpu)
    finally:
        torch.set_num_threads(threads)
    assert cold_s is not None
    return cold_s, hot_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    for k in range(rounds):
        cold_s, hot_s = cold_and_hot_s()
        print(json.dumps({"round": k, "cold_s": cold_s, "hot_s": hot_s, "ratio": cold_s / hot_s}))


if __name__ == "__main__":
    main()
