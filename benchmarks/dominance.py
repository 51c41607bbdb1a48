"""dp is never slower than the simple strategies at their own memory, in place.

For each model with repeated blocks (``tests/models_zoo.py`` BLOCK_MODELS: Hugging Face Llama,
GPT-2, BERT and ViT, the U-Net, the ResNet) and the reference GPT (``benchmarks/models.py``
GPT-ref, 787 priced ops), and each simple strategy (checkpoint every block,
every 2nd and every 3rd, sqrt(N) segments, Korthikanti's selective, torchtitan's op-level
SAC), the strategy's predicted peak and step time, and dp's predicted step time planned within
that peak. Every figure is ``simulate``'s on one in-place pricing of the model (the pricing a
plan makes, ``planner/inplace_form.py``).

    python -m benchmarks.dominance [--out benchmarks/results/dominance.json]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from planner.inplace_form import price_inplace
from planner.solvers.costgraph import CostGraph
from planner.solvers.registry import get_solver, solve
from planner.solvers.simulate import simulate

# (row name, solver, its options): what a user does by hand
STRATEGIES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("every-block", "uniform", {"k": 1}),
    ("uniform k=2", "uniform", {"k": 2}),
    ("uniform k=3", "uniform", {"k": 3}),
    ("sqrt", "sqrt", {}),
    ("selective", "selective", {}),
    ("sac", "sac", {}),
)
OUT = Path(__file__).parent / "results" / "dominance.json"


@dataclass(frozen=True)
class DominanceRow:
    """One strategy on one model and dp within its predicted peak."""

    model: str
    strategy: str
    peak_bytes: int
    step_time_s: float
    dp_peak_bytes: int
    dp_step_time_s: float

    @property
    def holds(self) -> bool:
        return self.dp_peak_bytes <= self.peak_bytes and self.dp_step_time_s <= self.step_time_s


def dominance_rows(model_name: str, graph: CostGraph) -> list[DominanceRow]:
    """Each strategy of STRATEGIES on ``graph`` (an in-place pricing), and dp at its peak."""
    rows = []
    for name, solver, options in STRATEGIES:
        own = simulate(graph, get_solver(solver)(graph, math.inf, **options))
        dp = simulate(graph, solve(graph, own.peak_bytes, "dp"))
        rows.append(
            DominanceRow(
                model_name,
                name,
                own.peak_bytes,
                own.step_time_s,
                dp.peak_bytes,
                dp.step_time_s,
            )
        )
    return rows


def markdown(rows: list[DominanceRow]) -> str:
    lines = [
        "| model | strategy | its peak | its step | dp's step at that peak | dp faster by |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        gain = 1 - r.dp_step_time_s / r.step_time_s
        lines.append(
            f"| {r.model} | {r.strategy} | {r.peak_bytes / 2**20:.3f} MiB | "
            f"{r.step_time_s * 1e3:.2f} ms | {r.dp_step_time_s * 1e3:.2f} ms | {gain:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    from benchmarks.models import gpt_ref_example
    from tests.models_zoo import BLOCK_MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows: list[DominanceRow] = []
    for name, example in {**BLOCK_MODELS, "gpt-ref": gpt_ref_example}.items():
        model, example_input = example()
        rows += dominance_rows(name, price_inplace(model, example_input).graph)
    print(markdown(rows))
    failed = [r for r in rows if not r.holds]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} hold")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "command": "python -m benchmarks.dominance",
        "rows": [{**asdict(r), "holds": r.holds} for r in rows],
    }
    args.out.write_text(json.dumps(body, indent=2) + "\n")
    if failed:
        raise SystemExit(f"dp is slower than {len(failed)} strategies at their peaks")


if __name__ == "__main__":
    main()
