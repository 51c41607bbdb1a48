"""Blocks the CPU allocator maps afresh, and their price in a step (fresh_memory.FreshMemory)."""

from __future__ import annotations

import copy
import dataclasses
import json
import mmap
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import planner
from benchmarks.page_faults import LargeBlocks
from planner import calibration
from planner.devices import profile_of_model
from planner.measurement import _step
from planner.passes import device_calibration, fresh_memory
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.passes.fresh_memory import FRESH_SHARE, FreshMemory
from tests.helpers import fake_calibration, readings_in_pairs

glibc = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
MiB = 1 << 20


def test_glibc_settings_decide_which_blocks_are_mapped_afresh():
    settings = fresh_memory.glibc_mapped_afresh_min_bytes
    assert settings({}) == 32 * MiB  # glibc's defaults
    assert settings({"MALLOC_MMAP_THRESHOLD_": str(4 * MiB)}) == 4 * MiB
    # the README's settings: nothing mapped
    assert settings({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}) is None
    assert settings({"GLIBC_TUNABLES": "glibc.malloc.check=0:glibc.malloc.mmap_max=0"}) is None
    assert settings({"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={MiB}"}) == MiB
    assert settings({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) is None
    assert settings({"MALLOC_MMAP_THRESHOLD_": "lots"}) == 32 * MiB  # ignored, as glibc does
    assert fresh_memory.mapped_afresh_min_bytes(torch.device("cuda")) is None  # a caching allocator


# benchmarks.page_faults' pointwise model (blocks of 32 MiB only), stepped in a process: the
# bytes of its large blocks per step, those faulted in per step, and the allocator's setting.
_STEPS = textwrap.dedent(
    """
    import json, statistics, torch
    from benchmarks.page_faults import faulted_share
    from planner.passes.fresh_memory import mapped_afresh_min_bytes

    torch.set_num_threads(1)
    large, faulted, _ = faulted_share("pointwise", steps=4)
    print(json.dumps({
        "large_bytes": large,
        "faulted_bytes": statistics.mean(faulted),
        "min_bytes": mapped_afresh_min_bytes(torch.device("cpu")),
    }))
    """
)


def _steps_in_a_process(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-c", _STEPS],
        env={**base, **env, "PYTHONPATH": root},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@glibc
def test_training_steps_fault_their_large_blocks_in_unless_glibc_is_told_not_to():
    """What FreshMemory stands on, in real training steps: with glibc's defaults a step faults
    in a large share of its blocks of 32 MiB or more, every step (FRESH_SHARE of them is
    charged); with the README's settings, little."""
    default = _steps_in_a_process()
    assert default["min_bytes"] == 32 * MiB
    assert default["large_bytes"] >= 8 * 32 * MiB
    assert default["faulted_bytes"] >= FRESH_SHARE * default["large_bytes"]  # all, here
    tuned = _steps_in_a_process(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 36))
    assert tuned["min_bytes"] is None
    assert tuned["large_bytes"] == default["large_bytes"]
    assert tuned["faulted_bytes"] < 0.15 * tuned["large_bytes"]  # one block of 14, here


def test_a_fresh_mapping_costs_its_faults_and_unmapping(monkeypatch):
    """Per fault, a fresh mapping's first write over its second (the zeroing and mapping), and
    its closing, each the median of three mappings: read off a fake clock and fault count (what
    the figures come to on a machine is a benchmark's: benchmarks/page_faults.py)."""
    fault_s, unmap_s = fresh_memory._mapping_costs_s()
    assert fault_s == fresh_memory.fault_cost_s()
    if fresh_memory.resource is None:
        assert fresh_memory.fresh_mapping_s_per_byte() == 0.0
        return
    assert fresh_memory.fresh_mapping_s_per_byte() * mmap.PAGESIZE == pytest.approx(
        fault_s + unmap_s
    )
    # three mappings of 1000 faults each: first writes 3, 5 and 4 ms, second writes 1 ms,
    # closings 0.5, 0.2 and 0.4 ms
    spans_s = iter([3e-3, 1e-3, 0.5e-3, 5e-3, 1e-3, 0.2e-3, 4e-3, 1e-3, 0.4e-3])
    now = readings_in_pairs(spans_s)  # the second of each pair of readings ends a span
    monkeypatch.setattr(fresh_memory, "clock", lambda device: now)
    monkeypatch.setattr(fresh_memory, "minor_faults", readings_in_pairs([1000] * 3))
    fault_s, unmap_s = fresh_memory._mapping_costs_s.__wrapped__()
    assert next(spans_s, None) is None  # three mappings, three spans each
    assert fault_s == pytest.approx((4e-3 - 1e-3) / 1000)
    assert unmap_s == pytest.approx(0.4e-3 / 1000)


def test_the_share_of_large_blocks_is_charged():
    fresh = FreshMemory(min_bytes=32 * MiB, seconds_per_byte=1e-9)
    sizes = [16 * MiB, 32 * MiB, 64 * MiB]
    assert fresh.cost_s(sizes) == pytest.approx(FRESH_SHARE * 96 * MiB * 1e-9)
    assert FreshMemory().cost_s(sizes) == 0.0


def test_the_estimate_charges_every_large_block_the_step_allocates():
    """With every op timed at 0, the predicted step is the fresh blocks' price alone: the
    share of the bytes of the step's blocks of 1 MiB or more, as a real step allocates them
    (activations, their gradients, the weights' gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.Tanh())
    x = torch.randn(384, 512)  # 1.5 MiB activations, 2 MiB weight gradients
    fresh = FreshMemory(min_bytes=MiB, seconds_per_byte=1e-9)

    def timer(calls, device):  # noqa: ANN001
        return fake_calibration(
            {c.key_text: 0.0 for c in calls},
            fresh_mapping_s_per_byte=fresh.seconds_per_byte,
            fresh_min_bytes=fresh.min_bytes,
        )

    c = capture(model, (x,))
    graph = estimate(
        c.module,
        c.args,
        c.kwargs,
        torch.sum,
        time_ops=True,
        timer=timer,
        rates=profile_of_model(c.module),
    )
    counted = LargeBlocks(MiB)
    with counted:
        _step(model, (x,), torch.sum)
    assert counted.total_bytes >= 4 * 1.5 * MiB + 2 * 2 * MiB  # there are blocks to price
    assert graph.step_time_s == pytest.approx(FRESH_SHARE * counted.total_bytes * 1e-9)
    assert "blocks of 1 MiB or more mapped afresh" in graph.meta["timing"]
    assert graph.meta["page_faults"].startswith(f"{graph.step_time_s:.3g} s of forward+backward")


def test_a_plan_says_when_page_faults_are_a_share_of_its_step(monkeypatch, tmp_path):
    """The same plan priced with blocks of 1 MiB mapped afresh: a slower step, and a summary
    line that says why and how to avoid it; with none mapped afresh, neither."""
    monkeypatch.setenv("PLANNER_CACHE", "0")
    monkeypatch.setattr(calibration, "SMALL_STEP_S", 0.0)  # priced from its calls, not fitted
    # A page at 40 us (this machine: 1.6 us), so that the faults pass the summary's share
    # however long the ops took: at the measured cost they sat at its edge, 5% of the step, and
    # a busy CI worker's slower ops took them under it. A pinned file: the second plan prices
    # the first's op times, so the two steps differ by the faults alone (timed twice, a burst
    # of load on CI once made the first 0.19 s and the second 0.13 s).
    pinned = tmp_path / "calibration.json"
    dataclasses.replace(calibration.current(), fresh_mapping_s_per_byte=1e-8).save(pinned)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.Tanh())
    x = torch.randn(384, 512)
    monkeypatch.setattr(device_calibration, "mapped_afresh_min_bytes", lambda device: None)
    reused = planner.plan(model, x, 1.0, loss_fn=torch.sum, calibration=pinned)
    monkeypatch.setattr(device_calibration, "mapped_afresh_min_bytes", lambda device: MiB)
    fresh = planner.plan(copy.deepcopy(model), x, 1.0, loss_fn=torch.sum, calibration=pinned)
    assert fresh.graph.step_time_s > reused.graph.step_time_s
    assert "page faults" in fresh.summary() and "MALLOC_MMAP_MAX_=0" in fresh.summary()
    assert "page faults" not in reused.summary()
