"""What the rewrite itself costs: step time of the rewritten module vs. hand-written checkpoints.

Two ratios on GPT-ref (CPU, median of interleaved runs of forward+loss+backward):

- ``per-block regions / hand-written``: the captured-and-rewritten module with one recompute
  region per transformer block, vs. the original model with each block wrapped by hand in
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. Target <= 1.02.
- ``no regions / original``: the captured module rewritten with no regions (what
  ``solver="none"`` returns) vs. the original eager model. Target <= 1.01.

Usage: ``python benchmarks/rewrite_overhead.py [--runs 9] [--small]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import gpt_ref_example, gpt_ref_small_example  # noqa: E402
from planner.passes.capture import capture  # noqa: E402
from planner.passes.regions import Region  # noqa: E402
from planner.passes.rewrite import CALL_OPS, region_name, rewrite  # noqa: E402


class HandCheckpoint(nn.Module):
    """What a user writes by hand: the block's forward under non-reentrant checkpoint."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def block_regions(gm: torch.fx.GraphModule, n_blocks: int) -> list[Region]:
    """One region per transformer block: the nodes whose module path is ``blocks.<i>...``."""
    taken: set[str] = set()
    regions = []
    for i in range(n_blocks):
        nodes = tuple(
            n.name
            for n in gm.graph.nodes
            if n.op in CALL_OPS
            and n.meta.get("nn_module_stack")
            and list(n.meta["nn_module_stack"].values())[-1][0].split(".")[:2] == ["blocks", str(i)]
        )
        name = region_name(gm, nodes, taken)
        taken.add(name)
        regions.append(Region(name, nodes))
    return regions


def step_time_s(module: nn.Module, example_input: tuple, params: list[nn.Parameter]) -> float:
    for p in params:
        p.grad = None
    start = time.perf_counter()
    module(*example_input).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="timed runs per variant (>= 7)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="GPT-ref-small (a smoke test)")
    args = parser.parse_args()

    model, example_input = (gpt_ref_small_example if args.small else gpt_ref_example)()
    n_blocks = len(model.blocks)
    gm = capture(model, example_input).module
    hand = copy.deepcopy(model)
    for i, block in enumerate(hand.blocks):
        hand.blocks[i] = HandCheckpoint(block)

    variants = {
        "original": (model, list(model.parameters())),
        "no regions": (rewrite(gm, []), list(model.parameters())),
        "hand-written": (hand, list(hand.parameters())),
        "per-block regions": (rewrite(gm, block_regions(gm, n_blocks)), list(model.parameters())),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for run in range(args.warmup + args.runs):
        # interleaved, so drift in machine load hits every variant alike
        for name, (module, params) in variants.items():
            torch.manual_seed(run)
            t = step_time_s(module, example_input, params)
            if run >= args.warmup:
                times[name].append(t)

    median = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{'GPT-ref-small' if args.small else 'GPT-ref'}, CPU, {torch.get_num_threads()} threads,"
    )
    print(f"median of {args.runs} interleaved forward+backward steps ({args.warmup} warm-up):")
    for name, t in median.items():
        spread = f"{min(times[name]):.3f}-{max(times[name]):.3f}"
        print(f"  {name:<18} {t:8.3f} s   (range {spread} s)")
    ckpt = median["per-block regions"] / median["hand-written"]
    none = median["no regions"] / median["original"]
    print(f"per-block regions / hand-written = {ckpt:.3f}  (target <= 1.02)")
    print(f"no regions / original            = {none:.3f}  (target <= 1.01)")


if __name__ == "__main__":
    main()
