"""A device's calibration: what planner measures about a device once and reuses for every plan.

A plan on the model's own device prices time from measurements made there
(``passes/op_timing.py``): each distinct aten call of the step (op, shapes, strides, dtypes)
timed alone, the step's per-call overhead (Python, autograd, dispatch: a stand-in chain stepped
for real, minus its calls timed alone) and a checkpoint region's bookkeeping (plain and
selective). Every figure comes from several short repeats (a CPU call's median run, the fastest
of the rest), so load on the machine moves it little, and none is a whole training step of the
model: a cold plan times only its ops.

:class:`Calibration` (``passes/device_calibration.py``) holds them for one (device, torch version,
dtype). This module keeps it

- per process: later plans (other budgets, batch sizes, lengths, objectives) reuse it and time
  only the calls it lacks (new shapes);
- on disk, in ``$PLANNER_CACHE_DIR`` (default ``~/.cache/planner``), one JSON file per key, read
  by later processes; ``PLANNER_CACHE=0`` turns the disk cache off (the process still keeps
  one). A call once timed keeps its figure: merging with the file, the file's figure wins, so
  every process that reads it prices alike.

``plan(..., calibration=path_or_calibration)`` pins one: given the same calibration, the same
inputs give the same plan (a path also receives the calls it lacked). Under
``torch.distributed`` rank 0's calibration is broadcast to every rank before pricing, so all
ranks price, and plan, alike (every rank must call ``plan``, as with any collective).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from planner.batch_sweep import BatchSweep, checked
from planner.calibration_counts import MEASUREMENTS
from planner.passes.cuda_timing import measure_workspace_bytes, workspace_bytes
from planner.passes.device_calibration import Calibration, CalibrationError, device_name
from planner.passes.fresh_memory import (
    fresh_mapping_s_per_byte,
)
from planner.passes.op_call import OpCall
from planner.passes.op_timing import time_each
from planner.passes.overhead_fits import (
    measure_call_overhead_s,
    measure_checkpoint_overhead,
)
from planner.passes.step import StepTime
from planner.passes.timing_runs import clock

# A step whose calls add up to less than this is also timed whole (plain, checkpointed and
# selective, a few interleaved rounds: well under a second), and its calls' times fitted to it:
# on a small model the Python, autograd and policy costs around the calls are most of the step
# and a stand-in chain prices them 20-40% off. Larger steps are priced from their calls alone.
SMALL_STEP_S = 0.05

CACHE_DIR_ENV = "PLANNER_CACHE_DIR"
CACHE_ENV = "PLANNER_CACHE"  # "0" (or "false", "off", "no"): no disk cache
DEFAULT_CACHE_DIR = Path("~/.cache/planner")


def cache_dir() -> Path | None:
    """Where calibrations are kept on disk (``$PLANNER_CACHE_DIR``, default
    ``~/.cache/planner``); None when ``PLANNER_CACHE=0`` turns the disk cache off."""
    if os.environ.get(CACHE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).expanduser()


def cache_path(key: tuple[str, str, str]) -> Path | None:
    """The file of calibration ``key`` (device, torch version, dtype) in :func:`cache_dir`."""
    where = cache_dir()
    if where is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", "-".join(key)).strip("_")
    return where / f"calibration-{slug}.json"


# (device, torch version, dtype) -> the process's calibration
_PROCESS: dict[tuple[str, str, str], Calibration] = {}


def _read_quietly(path: Path | None) -> Calibration | None:
    """The calibration at ``path``, or None when there is none or it is unreadable (a cache
    that cannot be read is measured anew and rewritten, never an error)."""
    if path is None or not path.exists():
        return None
    try:
        return Calibration.load(path)
    except CalibrationError:
        return None


def _merged(ours: Calibration, theirs: Calibration | None) -> Calibration:
    """``theirs`` (the file) with what only ``ours`` has: the first figure written wins."""
    if theirs is None or theirs.key != ours.key:
        return ours
    steps = {**ours.step_times_s, **theirs.step_times_s}
    return replace(theirs.with_times(ours.op_times_s, ours.workspace_bytes), step_times_s=steps)


def step_signature(calls: Sequence[OpCall]) -> str:
    """A step's identity for its whole-step timing: its calls, in order."""
    digest = hashlib.sha256()
    for call in calls:
        digest.update(call.key_text.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:32]


def _measure_new(device: torch.device, dtype: str) -> Calibration:
    MEASUREMENTS["overheads"] += 1
    return Calibration(
        device=device_name(device),
        torch_version=torch.__version__,
        dtype=dtype,
        call_overhead_s=measure_call_overhead_s(device),
        checkpoint=measure_checkpoint_overhead(device),
        fresh_mapping_s_per_byte=fresh_mapping_s_per_byte() if device.type == "cpu" else 0.0,
    )


def _time_missing(
    calibration: Calibration,
    calls: Sequence[OpCall],
    device: torch.device,
    scaled: Mapping[str, float] | None = None,
    expected: Mapping[str, float] | None = None,
):
    """The times of the calls ``calibration`` lacks: ``scaled``'s figure where it has one
    (``batch_sweep.scaled_times``), else timed now; a call timed now at over RETIME_JUMP times
    its ``expected`` figure (``batch_sweep.expected_times``) is timed again once the others
    are, and the faster figure kept (``batch_sweep.checked``)."""
    new: dict[str, float | None] = {}
    timed: dict[str, OpCall] = {}
    for call in calls:
        text = call.key_text
        if text in calibration.op_times_s or text in new or text in timed:
            continue
        if scaled is not None and text in scaled:
            new[text] = scaled[text]
            MEASUREMENTS["scaled"] += 1
            continue
        timed[text] = call
    MEASUREMENTS["ops"] += len(timed)
    for (text, call), seconds in zip(timed.items(), time_each(list(timed.values()), device)):
        new[text] = checked(call, seconds, (expected or {}).get(text), device)
    return new


def is_distributed() -> bool:
    """Whether this process is one rank of several (``torch.distributed``)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _broadcast(calibration: Calibration | None) -> Calibration:
    """Rank 0's calibration, on every rank."""
    import torch.distributed as dist

    box = [calibration.to_json() if calibration is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Calibration.from_json(box[0], "rank 0's calibration")


class CalibrationTimer:
    """The ``op_timing.Timer`` a plan prices with: the calibration of the model's device (the
    pinned one, the process's, the disk cache's or a new one), extended by the calls it lacks.

    ``pinned``: a :class:`Calibration` or the path of one (created if missing; the calls it
    lacked are written back to it); None: the process's and the disk cache's. ``sweep``: in
    ``fit_batch``, the sweep over batch sizes this step belongs to (``batch_sweep.BatchSweep``):
    the calls it shares with the last size's step, grown, are priced from that step's.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        pinned: Calibration | str | Path | None = None,
        step: Callable[[str], StepTime | None] | None = None,
        sweep: BatchSweep | None = None,
    ) -> None:
        """``step(clock)``: time the model's step whole (``measurement.measured_step_time``),
        done once per step signature and kept, if the step is small (SMALL_STEP_S)."""
        self.dtype = str(dtype).removeprefix("torch.")
        self.pinned = pinned
        self.step = step
        self.sweep = sweep
        self.used: Calibration | None = None
        self.source = "this process's" if pinned is None else f"pinned ({pinned})"

    def _start(self, device: torch.device) -> tuple[Calibration | None, Path | None]:
        """The calibration to extend (None: measure one) and the file to write it to."""
        key = (device_name(device), torch.__version__, self.dtype)
        if isinstance(self.pinned, Calibration):
            self._check(self.pinned, key, "the calibration given")
            return self.pinned, None
        if self.pinned is not None:
            path = Path(self.pinned)
            if not path.exists():
                return None, path
            found = Calibration.load(path)
            self._check(found, key, str(path))
            return found, path
        path = cache_path(key)
        found = _PROCESS.get(key)
        if found is None:
            found = _read_quietly(path)
            if found is not None:
                self.source = f"read from {path}"
        return found, path

    @staticmethod
    def _check(calibration: Calibration, key: tuple[str, str, str], where: str) -> None:
        """CalibrationError for a pinned calibration of another device or dtype: its times
        would price this one wrongly. (Another torch version is allowed: pinning says keep.)"""
        if (calibration.device, calibration.dtype) != (key[0], key[2]):
            raise CalibrationError(
                f"{where} calibrates {calibration.device} for {calibration.dtype}, this model "
                f"runs on {key[0]} in {key[2]}; pin a calibration made on this device "
                f"(planner.calibration.current(...).save(path)), or pass calibration=None"
            )

    def __call__(self, calls: Sequence[OpCall], device: torch.device) -> Calibration:
        distributed = is_distributed()
        import torch.distributed as dist

        rank0 = not distributed or dist.get_rank() == 0
        calibration = path = None
        if rank0:
            calibration, path = self._start(device)
            if calibration is None:
                calibration = _measure_new(device, self.dtype)
                self.source = "measured now"
            scaled = expected = None
            if self.sweep is not None:
                scaled, expected = self.sweep.estimates(calibration.op_times_s, calls, device)
            new = _time_missing(calibration, calls, device, scaled, expected)
            # measured as they were timed (cuda_timing.workspace_bytes); the scaled ones, not
            # timed, by one run each: a kernel's scratch is its library's choice at each size
            # (an algorithm, a split), not its rows times a ratio
            made = {c.key_text: c for c in calls if c.key_text in new}
            workspaces = {
                text: measure_workspace_bytes(c, device)
                if text in (scaled or {})
                else workspace_bytes(c, device)
                for text, c in made.items()
            }
            if new:
                calibration = calibration.with_times(new, workspaces)
            if self.sweep is not None:
                self.sweep.remember(calls, calibration.op_times_s)
            signature = step_signature(calls)
            timed = self._time_small_step(calibration, calls, device, signature)
            if timed is not None:
                steps = {**calibration.step_times_s, signature: timed}
                calibration = replace(calibration, step_times_s=steps)
            if path is not None and (new or timed is not None or not path.exists()):
                calibration = _merged(calibration, _read_quietly(path))
                try:
                    calibration.save(path)
                except OSError:
                    pass  # a read-only cache: this process keeps it all the same
            if new:
                self.source += f", {len(new)} calls timed now"
        else:
            signature = step_signature(calls)
        if distributed:
            calibration = _broadcast(calibration)
            self.source = "rank 0's, broadcast"
        assert calibration is not None
        if not isinstance(self.pinned, Calibration):
            _PROCESS[calibration.key] = calibration
        self.used = calibration
        return calibration.for_step(f"{calibration.device}, {self.source}", signature, device)

    def _time_small_step(
        self,
        calibration: Calibration,
        calls: Sequence[OpCall],
        device: torch.device,
        signature: str,
    ) -> tuple[float, float, float | None, float | None] | None:
        """The step timed whole, if it is small, has not been yet, and can be."""
        if self.step is None or signature in calibration.step_times_s:
            return None
        alone_s = sum(calibration.op_times_s.get(c.key_text) or 0.0 for c in calls)
        if alone_s >= SMALL_STEP_S:
            return None
        # the clock the op times were taken by (passes/timing_runs.clock)
        timed = self.step("cpu" if clock(device) is time.process_time else "wall")
        if timed is None:
            return None
        MEASUREMENTS["steps"] += 1
        return (timed.forward_s, timed.backward_s, timed.checkpointed_s, timed.selective_s)


def current(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Calibration:
    """The calibration this process holds for ``device`` and ``dtype`` (from the disk cache, or
    measured now without any op): to save, or to pin with ``plan(..., calibration=...)``.
    Under ``torch.distributed`` a collective (rank 0's is broadcast): call it on every rank."""
    device = torch.device(device)
    timer = CalibrationTimer(dtype)
    timer([], device)
    assert timer.used is not None
    return timer.used


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a model's calibration is kept under: its first floating parameter's."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def forget() -> None:
    """Drop this process's calibrations (the disk cache stays): the next plan reads the disk
    cache, or measures."""
    _PROCESS.clear()
