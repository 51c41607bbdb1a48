"""Device profiles: the rates the roofline prices time with, for a device you may not have.

A :class:`DeviceProfile` holds a device's FLOP rate, memory bandwidth and host<->device
bandwidth. Named profiles (``"h100"``, ``"a100-80gb"``, ``"a100-40gb"``, ``"cpu"``) let a plan for
an H100 be made on a laptop (model on the meta device); pass your own ``DeviceProfile(...)`` for
anything else. The GPU figures are datasheet peaks (dense bf16 tensor-core FLOP/s, HBM bytes/s,
PCIe bytes/s one way) derated to what eager PyTorch kernels typically reach; the ``"cpu"``
profile is measured on this machine by a short microbenchmark (a matmul and a large add), once,
and cached on disk.

This is the one table of device rates: the planner passes ``passes/`` the profile it prices
with (:func:`profile_of` for the model's own device). The type itself lives in
``planner/solvers/rates.py`` (torch-free, so ``passes/`` takes it without importing the planner).
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from planner.solvers.rates import DeviceProfile

# Datasheet peaks: (dense bf16 FLOP/s, HBM bytes/s, host link bytes/s one way). Keys are matched
# against torch.cuda.get_device_name() as well, so the order puts the specific names first.
_GPU_PEAKS = {
    "h200": (989e12, 4.8e12, 64e9),  # SXM, PCIe Gen5 x16
    "h100": (989e12, 3.35e12, 64e9),  # SXM, PCIe Gen5 x16
    "a100-80gb": (312e12, 2.04e12, 32e9),  # SXM, PCIe Gen4 x16
    "a100-40gb": (312e12, 1.555e12, 32e9),
    "a10": (125e12, 0.6e12, 32e9),
    "l4": (121e12, 0.3e12, 32e9),
    "v100": (125e12, 0.9e12, 16e9),
    "t4": (65e12, 0.32e12, 16e9),
    "4090": (165e12, 1.0e12, 32e9),
}
# CUDA compute capability of each: which fused attention kernels torch runs there
# (passes/attention_kernels.py).
_GPU_CAPABILITY = {
    "h200": (9, 0),
    "h100": (9, 0),
    "a100-80gb": (8, 0),
    "a100-40gb": (8, 0),
    "a10": (8, 6),
    "l4": (8, 9),
    "v100": (7, 0),
    "t4": (7, 5),
    "4090": (8, 9),
}
# What eager PyTorch kernels reach of the datasheet peak, for all three rates.
DERATE = 0.6
# The meta device (planning without hardware) is priced as this GPU unless told otherwise.
META_DEFAULT = "a100-80gb"
# How much of an offload region's own forward compute its copies to host hide behind on a GPU:
# planner's executor (passes/offload.py) copies out on a side stream (copy engines run beside
# the SMs); the share left exposed stands for the region's last saves and PCIe contending with
# HBM. (Its copies back are made at each unpack, all exposed: Rule 7.) An assumption, not a
# measurement: set your own with DeviceProfile(...).
GPU_OFFLOAD_OVERLAP = 0.8

PROFILES: dict[str, DeviceProfile] = {
    name: DeviceProfile(
        name,
        *(rate * DERATE for rate in peaks),
        offload_overlap=GPU_OFFLOAD_OVERLAP,
        compute_capability=_GPU_CAPABILITY[name],
    )
    for name, peaks in _GPU_PEAKS.items()
}

RATES_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "ckpt-planner", "rates.json")
_MEASURED: dict[str, tuple[float, float]] = {}


def known_profiles() -> list[str]:
    """The names :func:`device_profile` accepts."""
    return [*PROFILES, "cpu"]


def device_profile(device: str | DeviceProfile) -> DeviceProfile:
    """A named profile (``"h100"``, ``"a100-80gb"``, ``"a100-40gb"``, ``"cpu"``, ...) or yours."""
    if isinstance(device, DeviceProfile):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"device must be a profile name or a planner.DeviceProfile, got {type(device).__name__}"
        )
    key = device.strip().lower()
    if key == "cpu":
        flops_per_s, bytes_per_s = device_rates(torch.device("cpu"))
        # Offloading on a CPU copies within the same memory: it frees nothing.
        return DeviceProfile(
            "cpu", flops_per_s, bytes_per_s, bytes_per_s, host_link=False, device_type="cpu"
        )
    if key in PROFILES:
        return PROFILES[key]
    raise ValueError(
        f"unknown device profile {device!r}; known: {', '.join(known_profiles())}, or pass "
        f"planner.DeviceProfile(name, flops_per_s, bytes_per_s, host_bytes_per_s) with your own "
        f"rates"
    )


def profile_of(device: torch.device) -> DeviceProfile:
    """The profile of a torch device a model lives on (meta: :data:`META_DEFAULT`)."""
    if device.type == "meta":
        return PROFILES[META_DEFAULT]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = _gpu_profile(name)
        if known is not None:
            return known
        flops_per_s, bytes_per_s = device_rates(device)
        host_bytes_per_s = PROFILES[META_DEFAULT].host_bytes_per_s
        return DeviceProfile(
            name,
            flops_per_s,
            bytes_per_s,
            host_bytes_per_s,
            offload_overlap=GPU_OFFLOAD_OVERLAP,
            compute_capability=torch.cuda.get_device_capability(device),
        )
    if device.type == "cpu":
        return device_profile("cpu")
    flops_per_s, bytes_per_s = device_rates(device)
    return DeviceProfile(
        device.type, flops_per_s, bytes_per_s, bytes_per_s, host_link=False, device_type=device.type
    )


def profile_of_model(model: torch.nn.Module) -> DeviceProfile:
    """The profile of the device ``model`` lives on: its first parameter's or buffer's (the CPU
    when it has neither), what ``passes/`` prices a model's own device with."""
    tensors = (*model.parameters(), *model.buffers())
    return profile_of(tensors[0].device if tensors else torch.device("cpu"))


def _gpu_profile(cuda_name: str) -> DeviceProfile | None:
    """The table's profile for a CUDA device name ("NVIDIA A100-SXM4-40GB" -> a100-40gb)."""
    name = cuda_name.lower()
    families = [(key, *key.partition("-")[::2]) for key in PROFILES]
    for key, family, memory in families:
        if family in name and memory and memory in name:
            return PROFILES[key]
    for key, family, _ in families:
        if family in name:
            return PROFILES[key]
    return None


def device_rates(device: torch.device) -> tuple[float, float]:
    """(FLOP/s, bytes/s) for the roofline runtime estimate of ``device``.

    Known GPUs and the meta device from the table; anything else (the CPU, an unknown GPU)
    measured once by a short microbenchmark and cached on disk.
    """
    if device.type == "meta":
        p = PROFILES[META_DEFAULT]
        return p.flops_per_s, p.bytes_per_s
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if (known := _gpu_profile(name)) is not None:
            return known.flops_per_s, known.bytes_per_s
    else:
        name = f"{platform.machine()}:{platform.processor()}:{torch.get_num_threads()} threads"
    key = f"{device.type}:{name}"
    if key not in _MEASURED:
        _MEASURED[key] = _cached_rates(key, device)
    return _MEASURED[key]


def _cached_rates(key: str, device: torch.device) -> tuple[float, float]:
    try:
        with open(RATES_CACHE) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return tuple(cached[key])  # type: ignore[return-value]
    rates = _microbenchmark(device)
    cached[key] = list(rates)
    try:
        os.makedirs(os.path.dirname(RATES_CACHE), exist_ok=True)
        with open(RATES_CACHE, "w") as f:
            json.dump(cached, f, indent=1)
    except OSError:
        pass  # a read-only home: measure again next time
    return rates


def _microbenchmark(device: torch.device, repeats: int = 5) -> tuple[float, float]:
    def best_s(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    with torch.no_grad():
        n = 1024
        a = torch.randn(n, n, device=device)
        flops_per_s = 2 * n**3 / best_s(lambda: a @ a)
        x = torch.randn(8 * 2**20, device=device)  # 32 MiB: beyond the caches
        out = torch.empty_like(x)
        bytes_per_s = 2 * x.nbytes / best_s(lambda: torch.add(x, 1.0, out=out))
    return flops_per_s, bytes_per_s
