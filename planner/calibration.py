"""A device's calibration: what planner measures about a device once and reuses for every plan.

A plan on the model's own device prices time from measurements made there
(``passes/op_timing.py``): each distinct aten call of the step (op, shapes, strides, dtypes)
timed alone, the step's per-call overhead (Python, autograd, dispatch: a stand-in chain stepped
for real, minus its calls timed alone) and a checkpoint region's bookkeeping (plain and
selective). Every figure comes from several short repeats (a CPU call's median run, the fastest
of the rest), so load on the machine moves it little, and none is a whole training step of the
model: a cold plan times only its ops.

:class:`Calibration` holds them for one (device, torch version, dtype). It is kept

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
import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from planner.batch_sweep import BatchSweep, checked
from planner.calibration_counts import MEASUREMENTS
from planner.file_format import check_header
from planner.passes.cuda_timing import measure_workspace_bytes, workspace_bytes
from planner.passes.fresh_memory import (
    FreshMemory,
    fresh_mapping_s_per_byte,
    mapped_afresh_min_bytes,
)
from planner.passes.op_call import OpCall
from planner.passes.op_timing import DeviceTiming, time_each
from planner.passes.overhead_fits import (
    CheckpointOverhead,
    measure_call_overhead_s,
    measure_checkpoint_overhead,
)
from planner.passes.step import StepTime
from planner.passes.timing_runs import clock
from planner.solvers.errors import PlannerError

# A step whose calls add up to less than this is also timed whole (plain, checkpointed and
# selective, a few interleaved rounds: well under a second), and its calls' times fitted to it:
# on a small model the Python, autograd and policy costs around the calls are most of the step
# and a stand-in chain prices them 20-40% off. Larger steps are priced from their calls alone.
SMALL_STEP_S = 0.05

CACHE_DIR_ENV = "PLANNER_CACHE_DIR"
CACHE_ENV = "PLANNER_CACHE"  # "0" (or "false", "off", "no"): no disk cache
DEFAULT_CACHE_DIR = Path("~/.cache/planner")
FORMAT = "planner-calibration"
# 2: kernel workspaces (``workspace_bytes``); a version-1 file lacks them and is measured anew.
# 3: CPU calls timed on data evicted from the caches (``passes/op_timing.py``); a version-2
# file's figures, timed on hot data, are measured anew.
# 4: what a block mapped afresh costs (``fresh_mapping_s_per_byte``), and page faults taken
# off timed calls at the cost of a private mapping's (version 3 priced a shared one's).
# 5: on CUDA, the host's time per call and the checkpoint bookkeeping (version 4 held 0 there).
# 6: the checkpoint bookkeeping measured with a layer of work between regions, as in a model,
# and small steps each timed after one of their own kind (version 5's were under half and 5-7%
# over, on a CPU).
# 7: an offload region's bookkeeping per storage it sends (``per_offloaded_storage_s``), not per
# saving node (an H200 measured GPT's offload plans at up to twice their price).
# 8: a CPU call's figure is its median cold run, not its fastest
# (``cpu_timing.cold_cpu_times``: on a shared VM the fastest priced GPT-ref's step 18% under
# its time).
VERSION = 8


class CalibrationError(PlannerError):
    """A calibration file that cannot be read, or one made for another device."""


@dataclass(frozen=True)
class Calibration:
    """What was measured about one device, for one torch version and dtype (module docstring).

    ``op_times_s``: seconds per call by ``OpCall.key_text`` (None: the call did not run on
    random tensors and is priced by the roofline). ``call_overhead_s``: what a training step
    spends per aten call beyond the call itself. ``checkpoint``: a region's bookkeeping.
    ``step_times_s``: small steps timed whole, by :func:`step_signature`: (forward, backward,
    checkpointed whole, selective whole; the last two None where it could not be
    checkpointed). ``workspace_bytes``: the kernel workspace of each call timed that has one
    (``op_timing.workspace_bytes``: CUDA only), by ``OpCall.key_text``, measured in the same
    runs as its time; a call timed here and not listed has none. ``fresh_mapping_s_per_byte``:
    on a CPU, what a block of memory mapped afresh costs per byte (``op_timing.FreshMemory``;
    which blocks are is the process's allocator settings', not the calibration's).
    """

    device: str
    torch_version: str
    dtype: str
    call_overhead_s: float
    checkpoint: CheckpointOverhead
    op_times_s: Mapping[str, float | None] = field(default_factory=dict)
    step_times_s: Mapping[str, tuple[float, float, float | None, float | None]] = field(
        default_factory=dict
    )
    workspace_bytes: Mapping[str, int] = field(default_factory=dict)
    fresh_mapping_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        # read-only: a calibration shared by plans must not change under them
        object.__setattr__(self, "op_times_s", MappingProxyType(dict(self.op_times_s)))
        object.__setattr__(self, "workspace_bytes", MappingProxyType(dict(self.workspace_bytes)))
        steps = {k: tuple(v) for k, v in self.step_times_s.items()}
        object.__setattr__(self, "step_times_s", MappingProxyType(steps))

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.device, self.torch_version, self.dtype)

    def timing(
        self, source: str = "", step: str | None = None, device: torch.device | None = None
    ) -> DeviceTiming:
        """The torch-free data the estimator prices with (``passes/op_timing.DeviceTiming``),
        with the step of signature ``step`` if it was timed whole, and the blocks this
        process's allocator for ``device`` maps afresh."""
        timed = self.step_times_s.get(step) if step is not None else None
        step_time = None if timed is None else StepTime(*timed)
        min_bytes = None if device is None else mapped_afresh_min_bytes(device)
        return DeviceTiming(
            self.op_times_s,
            self.call_overhead_s,
            self.checkpoint,
            source,
            step_time,
            self.workspace_bytes,
            FreshMemory(min_bytes, self.fresh_mapping_s_per_byte),
            host_overlaps=not self.device.startswith("cpu:"),
        )

    def with_times(
        self, times_s: Mapping[str, float | None], workspaces: Mapping[str, int] | None = None
    ) -> Calibration:
        """This calibration with more calls (``workspaces``: the kernel workspaces of those
        that have one); a call it already has keeps its figures, time and workspace."""
        new = {k: n for k, n in (workspaces or {}).items() if k not in self.op_times_s and n}
        return replace(
            self,
            op_times_s={**times_s, **self.op_times_s},
            workspace_bytes={**self.workspace_bytes, **new},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "device": self.device,
            "torch_version": self.torch_version,
            "dtype": self.dtype,
            "call_overhead_s": self.call_overhead_s,
            "checkpoint": asdict(self.checkpoint),
            "op_times_s": dict(sorted(self.op_times_s.items())),
            "step_times_s": {k: list(v) for k, v in sorted(self.step_times_s.items())},
            "workspace_bytes": dict(sorted(self.workspace_bytes.items())),
            "fresh_mapping_s_per_byte": self.fresh_mapping_s_per_byte,
        }

    @classmethod
    def from_json(cls, body: Any, where: str = "the calibration") -> Calibration:
        fix = "Delete it and plan again to calibrate anew."
        body = check_header(
            body, FORMAT, VERSION, CalibrationError, where=where, kind="calibration", fix=fix
        )
        try:
            ck = body["checkpoint"]
            return cls(
                device=str(body["device"]),
                torch_version=str(body["torch_version"]),
                dtype=str(body["dtype"]),
                call_overhead_s=float(body["call_overhead_s"]),
                checkpoint=CheckpointOverhead(
                    **{f.name: float(ck[f.name]) for f in fields(CheckpointOverhead)}
                ),
                op_times_s={
                    str(k): None if v is None else float(v) for k, v in body["op_times_s"].items()
                },
                step_times_s={
                    str(k): tuple(None if x is None else float(x) for x in v)
                    for k, v in body.get("step_times_s", {}).items()
                },
                workspace_bytes={str(k): int(v) for k, v in body["workspace_bytes"].items()},
                fresh_mapping_s_per_byte=float(body["fresh_mapping_s_per_byte"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CalibrationError(
                f"{where} is missing or has a malformed field ({e!r}); delete it and plan again "
                f"to calibrate anew"
            ) from None

    def save(self, path: str | Path) -> None:
        """Write this calibration as JSON (atomically: a reader never sees half a file)."""
        _write_json(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a calibration written by :meth:`save` (CalibrationError if it is not one)."""
        try:
            body = json.loads(Path(path).read_text())
        except OSError as e:
            raise CalibrationError(f"cannot read calibration {path}: {e}") from None
        except ValueError as e:
            raise CalibrationError(
                f"{path} is not JSON ({e}); delete it to calibrate anew"
            ) from None
        return cls.from_json(body, str(path))


def _write_json(path: Path, body: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=0)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared (CI) calibration
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def device_name(device: torch.device) -> str:
    """The name a calibration is kept under: the CUDA device's name, or the CPU's machine,
    processor and thread count (CPU kernels' speed depends on the threads torch uses)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        cpu = platform.processor() or platform.machine()
        return f"cpu:{cpu}:{torch.get_num_threads()} threads"
    return device.type


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

    def __call__(self, calls: Sequence[OpCall], device: torch.device) -> DeviceTiming:
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
            # measured as they were timed (op_timing.workspace_bytes); the scaled ones, not
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
        return calibration.timing(f"{calibration.device}, {self.source}", signature, device)

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
        # the clock the op times were taken by (passes/op_timing.clock)
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
