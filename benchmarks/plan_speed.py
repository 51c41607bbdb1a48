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

``--calibration`` instead times what a device calibration (``planner/calibration.py``) buys, in a
fresh cache directory (``PLANNER_CACHE_DIR``, a temporary one unless ``--cache-dir``):

- GPT-ref in place (``benchmarks.models.gpt_ref_example``, 12 blocks, width 256, 8 x 256 tokens):
  a cold ``plan()`` at 0.4 GB (targets: <= 15 s), a second plan of the same model in the same
  process at another budget (0.3 GB, <= 3 s: the pricing is reused), the first budget again,
  a new instance of the model at both budgets (traced anew, the calibration held), and a plan
  in a new process that reads the on-disk calibration (<= 5 s); whether three calls at 0.4 GB
  (the same model twice, a new instance once) and the two processes give the identical plan;
- ``fit_batch`` on GPT-ref (the sweep of BENCHMARKS.md: cap = eager's measured peak at batch 8),
  twice, each in a new process sharing the calibration (<= 120 s, the same pick);
- Mamba from the tiny config with ``max_recompute_flops_fraction`` (<= 60 s in all).

Each figure comes with the load average; pin the run as the targets were measured:
``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.plan_speed --calibration``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def _target(r: dict, target_s: float) -> str:
    """Whether a figure met its target, by the wall clock (and by CPU time, which the load
    does not stretch, when only that one did)."""
    if r["wall_s"] <= target_s:
        return f" [target <= {target_s:g} s: met]"
    cpu = "met by CPU time" if r["cpu_s"] <= target_s else "missed by CPU time too"
    return f" [target <= {target_s:g} s: missed by the wall clock, {cpu}]"


def _fingerprint(p) -> str:
    """What two plans must share to be the same plan."""
    regions = [(r.name, r.kind, r.depth, list(r.saved_nodes)) for r in p.regions]
    return json.dumps([regions, p.predicted_peak_bytes, round(p.predicted_step_time_s, 12)])


def _in_new_process(what: str, *args: str) -> dict:
    """Run ``what`` of this module in a new Python process (same environment, same cache)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.plan_speed", "--child", what, *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def gpt_ref_plan(budget_gb: float, model_and_input: tuple | None = None) -> dict:
    """One in-place plan of GPT-ref (``model_and_input``, or a new instance): seconds,
    regions, fingerprint."""
    import planner
    from benchmarks.models import gpt_ref_example

    model, x = model_and_input or gpt_ref_example()
    start = time.perf_counter()
    cpu0 = time.process_time()
    p = planner.plan(model, x, budget_gb, form="inplace")
    return {
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu0,
        "regions": len(p.regions),
        "step_s": p.predicted_step_time_s,
        "fingerprint": _fingerprint(p),
        "load": _load(),
    }


def gpt_ref_fit_batch() -> dict:
    import planner
    from benchmarks.models import gpt_ref_for_batch

    model, _ = gpt_ref_for_batch(1)
    cap_bytes = planner.measure(model, gpt_ref_for_batch(8)[1]).peak_bytes
    start = time.perf_counter()
    cpu0 = time.process_time()
    fit = planner.fit_batch(model, lambda b: gpt_ref_for_batch(b)[1], cap_bytes / 1e9)
    return {
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu0,
        "pick": fit.best_batch_size,
        "rows": [
            [r.batch_size, r.solver, r.samples_per_s, r.predicted_peak_bytes] for r in fit.rows
        ],
        "cap_bytes": cap_bytes,
        "load": _load(),
    }


def mamba_capped(fraction: float = 0.15, seq_len: int = 128) -> dict:
    """Mamba (tiny config) in place at 70% of its eager peak, recomputing at most
    ``fraction`` of the step's FLOPs: the whole plan() call."""
    import planner

    model, example = mamba_example(seq_len)
    eager = planner.measure(model, example).peak_bytes
    start = time.perf_counter()
    cpu0 = time.process_time()
    p = planner.plan(
        model, example, 0.7 * eager / 1e9, form="inplace", max_recompute_flops_fraction=fraction
    )
    return {
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu0,
        "regions": len(p.regions),
        "recompute_pct": 100 * p.predicted_recompute_flops / max(p.step_flops, 1),
        "note": p.schedule.note,
        "load": _load(),
    }


class _Lines(list):
    """The report's lines, each printed as it comes (a long run shows its parts as it goes)."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)

    def __iadd__(self, lines):  # noqa: ANN001
        for line in lines:
            self.append(line)
        return self


def calibration_report(what: list[str]) -> str:
    lines = _Lines()
    if "gpt-ref" in what:
        from benchmarks.models import gpt_ref_example

        model_and_input = gpt_ref_example()
        first = gpt_ref_plan(0.4, model_and_input)
        # the same process: the same model at another budget (a user re-planning), then the
        # first budget again; then a new instance, traced anew with the calibration held
        other = gpt_ref_plan(0.3, model_and_input)
        again = gpt_ref_plan(0.4, model_and_input)
        other_instance = gpt_ref_plan(0.3)
        third = gpt_ref_plan(0.4)
        new = _in_new_process("gpt-ref-plan", "0.4")
        same_calls = len({first["fingerprint"], again["fingerprint"], third["fingerprint"]}) == 1
        lines += [
            f"GPT-ref in place, cold plan(0.4 GB): {first['wall_s']:.1f} s wall "
            f"({first['cpu_s']:.1f} s CPU, {first['load']}){_target(first, 15)}, "
            f"{first['regions']} regions, predicted step {first['step_s']:.3f} s",
            f"second plan, same process, same model (0.3 GB): {other['wall_s']:.2f} s wall "
            f"({other['cpu_s']:.2f} s CPU, {other['load']}){_target(other, 3)}; 0.4 GB again: "
            f"{again['wall_s']:.2f} s; a new instance, traced anew with the held calibration: "
            f"{other_instance['wall_s']:.2f} s (0.3 GB), {third['wall_s']:.2f} s (0.4 GB)",
            f"new process, on-disk calibration (0.4 GB): {new['wall_s']:.2f} s wall "
            f"({new['cpu_s']:.2f} s CPU, {new['load']}){_target(new, 5)}",
            f"three calls identical: {same_calls}; two processes identical: "
            f"{new['fingerprint'] == first['fingerprint']}",
        ]
    if "fit-batch" in what:
        runs = [_in_new_process("fit-batch") for _ in range(2)]
        for k, r in enumerate(runs):
            rows = ", ".join(f"{b}: {s} {rate:.2f}/s" for b, s, rate, _ in r["rows"] if rate)
            how = "cold calibration" if k == 0 else "a new process, the calibration on disk"
            lines.append(
                f"fit_batch GPT-ref run {k + 1} ({how}): {r['wall_s']:.1f} s wall "
                f"({r['cpu_s']:.1f} s CPU, {r['load']}){_target(r, 120)}, pick batch "
                f"{r['pick']} ({rows})"
            )
        lines.append(
            f"same pick: {runs[0]['pick'] == runs[1]['pick']}; same rows: "
            f"{runs[0]['rows'] == runs[1]['rows']}"
        )
    if "mamba" in what:
        r = _in_new_process("mamba-capped")
        lines.append(
            f"Mamba (tiny) in place, max_recompute_flops_fraction=0.15, 70% of eager: "
            f"{r['wall_s']:.1f} s wall ({r['cpu_s']:.1f} s CPU, {r['load']}){_target(r, 60)}, "
            f"{r['regions']} regions, recomputes {r['recompute_pct']:.2f}%; {r['note']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--calibration",
        nargs="?",
        const="gpt-ref,fit-batch,mamba",
        help="time what a device calibration buys (gpt-ref, fit-batch, mamba; default all)",
    )
    parser.add_argument("--cache-dir", help="PLANNER_CACHE_DIR for --calibration")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "gpt-ref-plan":
            result = gpt_ref_plan(float(rest[0]))
        elif what == "fit-batch":
            result = gpt_ref_fit_batch()
        else:
            result = mamba_capped()
        print(json.dumps(result), flush=True)
        return
    if args.calibration:
        cache = args.cache_dir or tempfile.mkdtemp(prefix="planner-cache-")
        os.environ["PLANNER_CACHE_DIR"] = cache  # children inherit it
        print(f"calibration cache: {cache}", flush=True)
        calibration_report(args.calibration.split(","))
        return
    print(plan_speed(args.seq_len), flush=True)


if __name__ == "__main__":
    main()
