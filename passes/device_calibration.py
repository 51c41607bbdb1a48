"""A device's calibration as data: what was measured about one device, for one torch version and
dtype, kept in the process and on disk (``planner/calibration.py``) and handed to the estimator
(``estimate`` / ``eager_graph``, through their ``timer``) as it is. Torch-free data but for the
device it names; JSON on disk.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from planner.passes.file_format import check_header
from planner.passes.fresh_memory import FreshMemory, mapped_afresh_min_bytes
from planner.passes.overhead_fits import CheckpointOverhead
from planner.passes.step import StepTime
from planner.solvers.errors import PlannerError

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
    """What was measured about one device, for one torch version and dtype (kept per process
    and on disk by ``planner/calibration.py``).

    ``op_times_s``: seconds per call by ``OpCall.key_text`` (None: the call did not run on
    random tensors and is priced by the roofline). ``call_overhead_s``: what a training step
    spends per aten call beyond the call itself. ``checkpoint``: a region's bookkeeping.
    ``step_times_s``: small steps timed whole, by their calls' signature
    (``planner.calibration.step_signature``): (forward, backward,
    checkpointed whole, selective whole; the last two None where it could not be
    checkpointed). ``workspace_bytes``: the kernel workspace of each call timed that has one
    (``cuda_timing.workspace_bytes``: CUDA only), by ``OpCall.key_text``, measured in the same
    runs as its time; a call timed here and not listed has none. ``fresh_mapping_s_per_byte``:
    on a CPU, what a block of memory mapped afresh costs per byte (``fresh_memory.FreshMemory``;
    which blocks are is the process's allocator settings', not the calibration's).

    What one plan's pricing takes beside the measurements, neither saved nor compared
    (:meth:`for_step`): ``source``, where the calibration came from (for the graph's
    ``meta["timing"]``); ``step_time``, the plan's step timed whole, when it was cheap enough to
    time (``passes.step.StepTime``: the estimator fits the calls' times to it); and
    ``fresh_min_bytes``, the smallest block this process's allocator maps afresh (None: it
    reuses every size; :attr:`fresh_memory`).
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
    source: str = field(default="", compare=False)
    step_time: StepTime | None = field(default=None, compare=False)
    fresh_min_bytes: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # read-only: a calibration shared by plans must not change under them
        object.__setattr__(self, "op_times_s", MappingProxyType(dict(self.op_times_s)))
        object.__setattr__(self, "workspace_bytes", MappingProxyType(dict(self.workspace_bytes)))
        steps = {k: tuple(v) for k, v in self.step_times_s.items()}
        object.__setattr__(self, "step_times_s", MappingProxyType(steps))

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.device, self.torch_version, self.dtype)

    @property
    def host_overlaps(self) -> bool:
        """The host's per-call work overlaps the kernels (``overhead_fits.host_overlaps``): on
        an accelerator each call costs at least ``call_overhead_s``, on the CPU that much more."""
        return not self.device.startswith("cpu:")

    @property
    def fresh_memory(self) -> FreshMemory:
        """What the blocks a call allocates cost when the allocator maps them afresh."""
        return FreshMemory(self.fresh_min_bytes, self.fresh_mapping_s_per_byte)

    def for_step(
        self, source: str = "", step: str | None = None, device: torch.device | None = None
    ) -> Calibration:
        """This calibration as one plan prices with it: from ``source``, with the step of
        signature ``step`` if it was timed whole, and the blocks this process's allocator for
        ``device`` maps afresh."""
        timed = self.step_times_s.get(step) if step is not None else None
        return replace(
            self,
            source=source,
            step_time=None if timed is None else StepTime(*timed),
            fresh_min_bytes=None if device is None else mapped_afresh_min_bytes(device),
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
