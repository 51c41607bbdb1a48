"""Kernel workspaces in a device's calibration (planner/calibration.py): kept by call as the
times are, in the process and on disk, the first figure written winning; a calibration file
from before them (format version 1) is measured anew. No CUDA here: the figures are injected
where ``cuda_timing.workspace_bytes`` would give them, and no op is timed for real."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from planner import batch_sweep, calibration
from planner.calibration import Calibration, CalibrationError, CalibrationTimer
from planner.devices import profile_of_model
from planner.passes.eager import eager_graph
from planner.passes.overhead_fits import CheckpointOverhead
from tests.helpers import each_with

pytestmark = pytest.mark.filterwarnings("ignore::planner.LossFallbackWarning")


def _calibration(**fields) -> Calibration:
    base = Calibration(
        device="cuda:NVIDIA H200",
        torch_version=torch.__version__,
        dtype="float32",
        call_overhead_s=0.0,
        checkpoint=CheckpointOverhead(),
        op_times_s={"a": 1e-5, "b": 2e-5, "c": None},
        workspace_bytes={"a": 4096},
    )
    return dataclasses.replace(base, **fields)


def test_workspaces_round_trip_through_json_and_disk(tmp_path):
    held = _calibration()
    assert held.to_json()["workspace_bytes"] == {"a": 4096}
    held.save(tmp_path / "c.json")
    loaded = Calibration.load(tmp_path / "c.json")
    assert loaded == held and dict(loaded.workspace_bytes) == {"a": 4096}
    assert dict(loaded.for_step().workspace_bytes) == {"a": 4096}
    with pytest.raises(TypeError):
        loaded.workspace_bytes["b"] = 1  # type: ignore[index]  # read-only, as its times


def test_a_call_keeps_its_first_workspace_figure():
    held = _calibration()
    more = held.with_times({"a": 9.0, "d": 3e-5, "e": 1e-6}, {"a": 1, "d": 512, "e": 0})
    assert more.op_times_s["a"] == 1e-5 and more.workspace_bytes["a"] == 4096  # had both
    assert more.workspace_bytes["d"] == 512 and "e" not in more.workspace_bytes  # 0: none
    # the file's figures win for the calls both have, as with times: "b" has none on disk
    ours = dataclasses.replace(held, workspace_bytes={"a": 1, "b": 2048})
    merged = calibration._merged(ours, held)
    assert dict(merged.workspace_bytes) == {"a": 4096}


def test_a_version_1_file_is_measured_anew_or_refused_when_pinned(tmp_path):
    old = _calibration().to_json()
    old["version"] = 1
    del old["workspace_bytes"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert calibration._read_quietly(path) is None  # the disk cache: measured anew
    with pytest.raises(CalibrationError, match="version 1.*calibrate anew"):
        Calibration.load(path)


def test_a_sweeps_scaled_calls_have_their_workspace_measured_at_their_own_size(monkeypatch):
    """fit_batch prices a larger batch's slow calls from the smaller batch's times, untimed;
    their scratch is measured by one run each at their own size, not scaled (a library picks
    its kernel, and so its scratch, per size)."""
    monkeypatch.setenv("PLANNER_CACHE", "0")
    monkeypatch.setattr(calibration, "measure_call_overhead_s", lambda device: 0.0)
    monkeypatch.setattr(
        calibration, "measure_checkpoint_overhead", lambda device: CheckpointOverhead()
    )
    timed, measured = [], []

    def time_call(call, device, repeats=5):
        timed.append(call.key_text)
        return 2e-3  # slow enough to be scaled at the next batch size (SCALE_MIN_S)

    def measure_workspace_bytes(call, device):
        measured.append(call.key_text)
        return 4096

    monkeypatch.setattr(batch_sweep, "time_call", time_call)
    monkeypatch.setattr(calibration, "time_each", each_with(time_call))
    monkeypatch.setattr(calibration, "workspace_bytes", lambda call, device: 0)
    monkeypatch.setattr(calibration, "measure_workspace_bytes", measure_workspace_bytes)
    monkeypatch.setattr(batch_sweep, "per_op_corrected", lambda scaled, calls, device: scaled)
    calibration.forget()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    rates = profile_of_model(model)
    timer = CalibrationTimer(torch.float32, sweep=batch_sweep.BatchSweep())
    for batch in (2, 4):
        timed.clear()
        eager_graph(model, torch.randn(batch, 8), rates=rates, time_ops=True, timer=timer)
        if batch == 2:
            assert timed and not measured  # timed: their scratch seen as they ran
    assert measured and not set(measured) & set(timed)
    used = timer.used.workspace_bytes
    assert all(used[text] == 4096 for text in measured)
    calibration.forget()


def test_the_calibration_timer_keeps_and_prices_measured_workspaces(tmp_path, monkeypatch):
    """The plan's timer stores each call's workspace beside its time, on disk, and a new
    process prices from the file the same working sets."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLANNER_CACHE", raising=False)
    monkeypatch.setattr(calibration, "measure_call_overhead_s", lambda device: 0.0)
    monkeypatch.setattr(
        calibration, "measure_checkpoint_overhead", lambda device: CheckpointOverhead()
    )

    def time_call(call, device, repeats=5):
        return 1e-6

    monkeypatch.setattr(batch_sweep, "time_call", time_call)
    monkeypatch.setattr(calibration, "time_each", each_with(time_call))
    # what op_timing measures on CUDA, injected: every matmul-like call has 1 MB of scratch
    monkeypatch.setattr(
        calibration,
        "workspace_bytes",
        lambda call, device: 10**6 if "mm" in str(call.op) else 0,
    )
    calibration.forget()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 8)
    rates = profile_of_model(model)

    def priced():
        timer = CalibrationTimer(torch.float32)
        graph = eager_graph(model, x, rates=rates, time_ops=True, timer=timer).graph
        return graph, timer.used

    first, used = priced()
    assert used.workspace_bytes and set(used.workspace_bytes.values()) == {10**6}
    assert "kernel workspaces" in first.meta["timing"]
    (path,) = (tmp_path / "cache").glob("calibration-*.json")
    assert Calibration.load(path) == used
    calibration.forget()  # a new process: read from disk, nothing measured
    monkeypatch.setattr(calibration, "workspace_bytes", lambda call, device: 0)
    again, _ = priced()
    assert [n.fwd_temp_bytes for n in again.nodes] == [n.fwd_temp_bytes for n in first.nodes]
    assert [n.bwd_temp_bytes for n in again.nodes] == [n.bwd_temp_bytes for n in first.nodes]
    calibration.forget()
