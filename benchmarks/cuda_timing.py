"""Timing on a CUDA device, measured: op timing waits for the kernels, the host's overheads per
call and per region are microseconds, and recomputing the forward costs measured time.

    python -m benchmarks.cuda_timing [--out benchmarks/results/cuda_timing-<gpu>.json]

Prints one JSON object: the figures and, for each, the check it should pass (``checks``); exits
1 when a check fails. These read the device's clock, so they are a benchmark, not unit tests
(``tests/passes/test_op_timing.py`` checks with a fake clock that the CUDA clock is read after
the device is synchronised).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from benchmarks.models import GPTConfig, gpt_example
from planner.measurement import measured_step_time
from planner.passes.op_call import op_call
from planner.passes.op_timing import time_calls
from planner.passes.overhead_fits import call_overhead_s, checkpoint_overhead

MICROSECOND_S, MILLISECOND_S = 1e-6, 1e-3


def matmul_times_s(device: torch.device) -> tuple[float, float]:
    """Timed 1024^3 and 4096^3 float32 matmuls: 64x the work apart. Without synchronising both
    would take the launch time."""
    small, large = (torch.randn(n, n, device=device) for n in (1024, 4096))
    calls = [op_call(torch.ops.aten.mm.default, (a, a), {}) for a in (small, large)]
    times = time_calls(calls, device)
    return times[calls[0].key], times[calls[1].key]


def recompute_times_s(device: torch.device) -> Any:
    """A step wide enough that the kernels, not the host, set its time, timed plain,
    checkpointed whole and selectively."""
    cfg = GPTConfig(n_layer=4, d_model=1024, n_head=8, seq_len=512, vocab_size=1024)
    model, example = gpt_example(cfg, batch=8, seed=0)
    return measured_step_time(model.to(device), tree_map(lambda t: t.to(device), example))


def figures(device: torch.device) -> dict[str, Any]:
    small_s, large_s = matmul_times_s(device)
    overhead = checkpoint_overhead(device)
    offload_s = overhead.offload_region_s + overhead.per_offloaded_storage_s
    call_s = call_overhead_s(device)
    timed = recompute_times_s(device)
    checks = {
        "the large matmul takes over 16x the small one": large_s > 16 * small_s,
        "no float32 matmul runs at 2 PFLOP/s": 2 * 4096**3 / large_s < 2e15,
        "a call's host overhead is 1 us to 1 ms": MICROSECOND_S < call_s < MILLISECOND_S,
        "a region's is 1 us to 10 ms": MICROSECOND_S < overhead.region_s < 10 * MILLISECOND_S,
        "an offload region's is 1 us to 10 ms": MICROSECOND_S < offload_s < 10 * MILLISECOND_S,
        "checkpointed whole is slower than plain": timed.checkpointed_s > timed.step_s,
        "selective is slower than plain": timed.selective_s > timed.step_s,
    }
    return {
        "device": torch.cuda.get_device_name(device),
        "mm_1024_s": small_s,
        "mm_4096_s": large_s,
        "call_overhead_s": call_s,
        "region_overhead_s": overhead.region_s,
        "offload_region_overhead_s": offload_s,
        "step_s": timed.step_s,
        "checkpointed_step_s": timed.checkpointed_s,
        "selective_step_s": timed.selective_s,
        "checks": checks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    result = figures(torch.device("cuda"))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
