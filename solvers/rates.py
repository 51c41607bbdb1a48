"""The rates a device prices time with, as data: torch-free, so that ``passes/`` and the solvers
take them without importing ``planner/devices.py``, which builds them (named profiles, the model's
own device, the CPU's measured rates) and re-exports the type as ``planner.DeviceProfile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device for the roofline: time = max(FLOPs / flops_per_s, bytes / bytes_per_s).

    ``host_bytes_per_s`` prices offloading (device -> host and back). ``host_link``: host memory
    is not the device's, so offloading frees device memory (False on a CPU, where solvers then
    never offload). ``offload_overlap``: the share of an offload region's own compute its
    transfers hide behind (simulate's Rule 7). ``device_type``: the kernels it runs, "cuda" or
    "cpu" (None: by ``host_link``); a plan made elsewhere prices the ops whose kernel depends
    on the device, fused attention, as this one runs them. ``compute_capability``: a CUDA
    device's (major, minor), which decides among its attention kernels (None: unknown, the
    largest candidate is priced).
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    host_bytes_per_s: float
    host_link: bool = True
    offload_overlap: float = 0.0
    device_type: str | None = None
    compute_capability: tuple[int, int] | None = None

    @property
    def kernels(self) -> str:
        """Whose kernels the device runs, "cuda" or "cpu": ``device_type``, else a device
        with its own memory (``host_link``) is taken for a CUDA GPU, one without for a CPU."""
        return self.device_type or ("cuda" if self.host_link else "cpu")

    def __post_init__(self) -> None:
        for field_name in ("flops_per_s", "bytes_per_s", "host_bytes_per_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            ):
                raise ValueError(
                    f"DeviceProfile.{field_name} must be a positive finite rate, got {value!r}"
                )
        if not 0.0 <= self.offload_overlap <= 1.0:
            raise ValueError(
                f"DeviceProfile.offload_overlap is a share of compute in [0, 1], got "
                f"{self.offload_overlap!r}"
            )
