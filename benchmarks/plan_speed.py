"""How long ``planner.plan`` takes, phase by phase: capture, estimate, solve, build.

The model: Hugging Face Mamba from a tiny config (hidden 32, 2 layers, no download) at sequence
length 128, whose slow selective scan unrolls over the sequence into ~2,800 graph nodes; planned
with ``auto`` (its default time limit, ``solvers/auto.py`` AUTO_TIME_LIMIT_S) at 70% of its
measured eager peak, then ``planner.measure`` of ``p.module`` against the budget. Target: the
whole ``plan()`` within 30 s, measured peak within budget.

Each phase is timed through the pipeline's own progress callback (``planning.price`` and
``PricedModel.plan``, which is all ``planner.plan`` runs), as wall time and as this process's
CPU time (``time.process_time``), with the load average: on a shared machine the wall time is
the CPU time stretched by the load.

Run: ``python -m benchmarks.plan_speed`` (``--seq-len 64`` for another length).
"""

from __future__ import annotations

import argparse
import os
import time

MIB = 2**20


class PhaseClock:
    """``on_step`` callback for the pipeline: wall and CPU seconds of each named phase."""

    def __init__(self) -> None:
        self.wall_s: dict[str, float] = {}
        self.cpu_s: dict[str, float] = {}
        self._current: str | None = None
        self._wall0 = self._cpu0 = 0.0

    def __call__(self, step: str) -> None:
        self.stop()
        self._current, self._wall0, self._cpu0 = step, time.perf_counter(), time.process_time()

    def stop(self) -> None:
        if self._current is not None:
            name = self._current
            self.wall_s[name] = self.wall_s.get(name, 0.0) + time.perf_counter() - self._wall0
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + time.process_time() - self._cpu0
        self._current = None


def mamba_example(seq_len: int):
    """A tiny Mamba language model (seed 0) and a {"input_ids", "labels"} batch of one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, use_mambapy=False
    )
    model = MambaForCausalLM(config)
    ids = torch.randint(0, 64, (1, seq_len))
    return model, {"input_ids": ids, "labels": ids}


def plan_speed(seq_len: int = 128, budget_fraction: float = 0.7) -> str:
    import planner
    from planner.planning import price

    model, example = mamba_example(seq_len)
    eager = planner.measure(model, example).peak_bytes
    budget_bytes = round(budget_fraction * eager)
    clock = PhaseClock()
    start = time.perf_counter()
    priced = price(model, example, on_step=clock)
    p = priced.plan(budget_bytes, "auto", on_step=clock)
    clock.stop()
    plan_s = time.perf_counter() - start
    measured = planner.measure(p.module, example).peak_bytes
    phases = ", ".join(
        f"{name} {clock.wall_s[name]:.1f} s ({clock.cpu_s[name]:.1f} s CPU)"
        for name in clock.wall_s
    )
    return (
        f"Mamba (hidden 32, 2 layers, seq {seq_len}): {len(p.graph.nodes)} nodes; plan(auto) "
        f"{plan_s:.1f} s wall, {sum(clock.cpu_s.values()):.1f} s CPU: {phases}; load average "
        f"{os.getloadavg()[0]:.1f}; solver {p.solver}; budget {budget_bytes / MIB:.2f} MiB "
        f"({budget_fraction:.0%} of the measured eager {eager / MIB:.2f} MiB), predicted "
        f"{p.predicted_peak_bytes / MIB:.2f} MiB, measured {measured / MIB:.2f} MiB: "
        f"{'within' if measured <= budget_bytes else 'OVER'} budget; note: {p.schedule.note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    print(plan_speed(args.seq_len), flush=True)


if __name__ == "__main__":
    main()
