"""How much of a CPU step's large blocks fault in: the data behind ``fresh_memory.FRESH_SHARE``.

    python -m benchmarks.page_faults [--models gpt-ref-32,gpt-ref-64,gpt-512,mlp,pointwise]
                                     [--steps 4]

glibc maps each block of 32 MiB or more afresh unless a free heap chunk fits it (README: page
faults). Per model, in a process of its own, eager training steps after a warm-up: the bytes of the
blocks of 32 MiB or more a step allocates (``LargeBlocks``), the bytes it faulted in (minor
page faults x the page size), their share, and the system time per step. Run it with glibc's
defaults; with ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736`` the shares fall to
about 0. Linux only (the fault count is getrusage's).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.models import GPTConfig, gpt_example, gpt_ref_for_batch

LARGE_BYTES = 32 << 20


class LargeBlocks(TorchDispatchMode):
    """The bytes of every new storage of ``min_bytes`` or more the ops run under it allocate."""

    def __init__(self, min_bytes: int = LARGE_BYTES) -> None:
        super().__init__()
        self.min_bytes, self.total_bytes = min_bytes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for returned, x in zip(func._schema.returns, outs):
            if isinstance(x, torch.Tensor) and returned.alias_info is None:
                if (n := x.untyped_storage().nbytes()) >= self.min_bytes:
                    self.total_bytes += n
        return out


class Pointwise(nn.Module):
    """Pointwise ops on blocks of 32 MiB (a 4096 x 2048 input): a step of large blocks only."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2048))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(x * self.w)
        h = nn.functional.gelu(h * self.w)
        return torch.tanh(h * self.w).sum()


def _mlp():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(2048, 2048), nn.GELU()) for _ in range(6)]
    return nn.Sequential(*layers), torch.randn(8192, 2048)


MODELS = {
    "gpt-ref-32": lambda: gpt_ref_for_batch(32),
    "gpt-ref-64": lambda: gpt_ref_for_batch(64),
    "gpt-512": lambda: gpt_example(GPTConfig(n_layer=4, d_model=512, n_head=8, seq_len=512), 8),
    "mlp": _mlp,
    "pointwise": lambda: (Pointwise(), torch.randn(4096, 2048)),
}


def _step(model: nn.Module, example: Any) -> None:
    for p in model.parameters():
        p.grad = None
    out = model(*example) if isinstance(example, tuple) else model(example)
    (out if out.dim() == 0 else out.float().pow(2).mean()).backward()


def faulted_share(name: str, steps: int) -> tuple[int, list[float], list[float]]:
    """(large-block bytes per step, bytes faulted in each step, system seconds each step)."""
    import resource  # Unix only: LargeBlocks imports anywhere

    model, x = MODELS[name]()
    _step(model, x)  # warm-up
    blocks = LargeBlocks()
    with blocks:
        _step(model, x)
    faulted, system = [], []
    for _ in range(steps):
        before, faults = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _step(model, x)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        faulted.append(faults * mmap.PAGESIZE)
        system.append(os.times().system - before.system)
    return blocks.total_bytes, faulted, system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a model, in this process: JSON
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        large, faulted, system = faulted_share(args.one, args.steps)
        print(json.dumps([large, faulted, system]))
        return
    print("| model | blocks of 32 MiB+ per step | faulted per step | share | system s/step |")
    print("|---|---:|---:|---:|---:|")
    shares = []
    for name in args.models.split(","):
        # each model in a process of its own: what a process allocated before decides which
        # blocks a free heap chunk fits (after GPT-ref's batch 64, the others faulted nothing)
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.page_faults",
                "--one",
                name,
                "--steps",
                str(args.steps),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        large, faulted, system = json.loads(run.stdout.splitlines()[-1])
        share = statistics.mean(faulted) / max(large, 1)
        shares.append(share)
        print(
            f"| {name} | {large / 2**30:.2f} GiB | "
            f"{min(faulted) / 2**30:.2f}-{max(faulted) / 2**30:.2f} GiB | {share:.2f} | "
            f"{statistics.mean(system):.2f} |",
            flush=True,
        )
    print(f"\nmean share {statistics.mean(shares):.2f} (fresh_memory.FRESH_SHARE)")


if __name__ == "__main__":
    main()
