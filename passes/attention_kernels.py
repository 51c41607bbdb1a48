"""Fused attention priced as the target device runs it, when the plan is made elsewhere.

``F.scaled_dot_product_attention`` picks its kernel at run time from the device and the call:
on CUDA flash attention, memory-efficient attention, cuDNN or the math fallback
(``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``), on the CPU
its own flash kernel or math. What the kernel keeps for backward differs by orders of
magnitude: math keeps the (S, S) attention weights, flash and memory-efficient only the output
and a log-sum-exp per row. A model on the meta device runs math (meta has no fused kernel), and
a CPU model runs the CPU's kernels, so a plan made there for a GPU would price a kernel the GPU
never runs. :class:`TargetAttention` replaces each call, during pricing only, with the aten
kernel the target device would dispatch, as the dispatcher calls it (a boolean mask made
additive first, flash's head dim padded to a multiple of 8, memory-efficient's mask padded
and expanded), so its saves, allocations, FLOPs and op name (which a selective policy keys
on) are the target's. The choice follows torch's documented conditions: dtype, head dim,
mask, dropout, grouped-query heads, causal with unequal lengths, the GPU's compute
capability, and the enabled backends in torch's priority order (``torch.nn.attention``'s
``sdpa_kernel`` context applies). Where the choice cannot be known (a profile without a compute
capability, cuDNN's constraints), the candidate that keeps the most is priced, and said so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from planner.solvers.rates import DeviceProfile

# torch's SDPBackend values (torch._C._SDPBackend), as the priority order lists them.
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
# Most kept for backward first: where the choice cannot be known, the first candidate.
_LARGEST_FIRST = ("math", "efficient", "cudnn", "flash")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionCall:
    """What torch's backend choice reads of one ``scaled_dot_product_attention`` call."""

    dtype: torch.dtype
    head_dim: int
    value_head_dim: int
    has_mask: bool
    dropout_p: float
    is_causal: bool
    grouped_query: bool  # key/value have fewer heads than the query
    square: bool  # as many queries as keys

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        parts = [dtype, f"head dim {self.head_dim}", "mask" if self.has_mask else "no mask"]
        parts += ["causal"] * self.is_causal + ["grouped-query"] * self.grouped_query
        parts += [f"dropout {self.dropout_p:g}"] * (self.dropout_p > 0)
        return ", ".join(parts)


def _flash_fails(call: AttentionCall, capability: tuple[int, int]) -> str | None:
    """Why CUDA's flash kernel refuses ``call`` (None: it runs it)."""
    if capability < (8, 0):
        return "flash needs compute capability 8.0"
    if call.dtype not in _HALF:
        return "flash needs float16 or bfloat16"
    if call.has_mask:
        return "flash takes no attention mask"
    if call.head_dim != call.value_head_dim or call.head_dim > 256:
        return "flash needs equal head dims of at most 256"
    if call.is_causal and not call.square:
        return "flash refuses causal attention with unequal lengths"
    if capability in ((8, 6), (8, 9)) and call.head_dim > 192:
        return "flash's backward on sm86/sm89 takes head dims up to 192"
    return None


def _efficient_fails(call: AttentionCall, capability: tuple[int, int]) -> str | None:
    """Why CUDA's memory-efficient kernel refuses ``call`` (None: it runs it)."""
    if capability < (5, 0) or (call.dtype == torch.bfloat16 and capability < (8, 0)):
        return "memory-efficient attention needs a newer GPU for this dtype"
    if call.dtype not in (*_HALF, torch.float32):
        return "memory-efficient attention needs float16, bfloat16 or float32"
    if call.grouped_query:
        return "memory-efficient attention needs as many key heads as query heads"
    alignment = 8 if call.dtype in _HALF else 4
    if call.head_dim % alignment or call.value_head_dim % alignment:
        return f"memory-efficient attention needs head dims that are multiples of {alignment}"
    return None


def cuda_backend(call: AttentionCall, capability: tuple[int, int] | None) -> tuple[str, str]:
    """(kernel, why) that ``select_sdp_backend`` picks on a CUDA device of ``capability``: the
    first enabled backend in torch's priority order whose conditions ``call`` meets."""
    enabled = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
    }
    order = [_BACKEND_NAMES[b] for b in torch._C._get_sdp_priority_order() if b in _BACKEND_NAMES]
    if capability is None:
        candidates = [b for b in order if enabled[b]]
        largest = min(candidates, key=_LARGEST_FIRST.index)
        return largest, "the device's compute capability is unknown: the largest candidate"
    refusals = []
    for backend in order:
        if not enabled[backend]:
            continue
        if backend == "math":
            return "math", "; ".join(refusals) or "math is first in torch's priority order"
        if backend == "cudnn":  # its constraints vary by cuDNN version: not known here
            rest = [b for b in order[order.index("cudnn") :] if enabled[b]]
            return min(rest, key=_LARGEST_FIRST.index), "cuDNN may or may not take it"
        fails = (_flash_fails if backend == "flash" else _efficient_fails)(call, capability)
        if fails is None:
            return backend, "; ".join([*refusals, f"{backend} takes it"])
        refusals.append(fails)
    return "math", "no fused kernel is enabled"


def cpu_backend(call_args: tuple[torch.Tensor, ...], **kwargs: Any) -> str:
    """The kernel the CPU dispatcher picks for a call on tensors shaped as ``call_args``: asked
    of torch itself, on stand-ins that share their dtype, shape and last stride but hold one
    row (stride 0 elsewhere: no memory of the call's size)."""

    def stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.empty(t.shape[-1], dtype=t.dtype).expand(t.shape)

    with _disable_current_modes():  # real tensors, outside the pricing's fake mode and tracker
        q, k, v, mask = (stand_in(t) for t in call_args)
        return _BACKEND_NAMES[torch._fused_sdp_choice(q, k, v, mask, **kwargs)]


def _bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}
    bound.update(dict(zip(names, args)), **kwargs)
    bound.setdefault("enable_gqa", False)
    return bound


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the dispatcher makes it before any kernel: 0 where kept, -inf not."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    minus_inf = torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, minus_inf)


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[-1] % multiple
    return F.pad(t, (0, extra)) if extra else t


def _run(backend: str, b: dict[str, Any], device_type: str) -> torch.Tensor:
    """``b``'s call as the dispatcher of ``device_type`` runs it with ``backend``."""
    q, k, v = b["query"], b["key"], b["value"]
    dropout_p, is_causal, scale = b["dropout_p"], b["is_causal"], b["scale"]
    if backend == "math":  # the dispatcher's own math path, on any device
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(**b)
    mask = _additive(b["attn_mask"], q.dtype)
    if device_type == "cpu":  # flash, the CPU's only fused kernel
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale
        )[0]
    if backend == "efficient":
        if mask is not None:
            width = mask.shape[-1]
            mask = _pad_last(mask, 16)[..., :width]
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, dropout_p, is_causal, scale=scale
        )[0]
    head_dim = q.shape[-1]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    padded = [_pad_last(t, 8) for t in (q, k, v)]
    if backend == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *padded, None, True, dropout_p, is_causal, False, scale=scale
        )[0]
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            *padded, dropout_p, is_causal, False, scale=scale
        )[0]
    return out[..., :head_dim] if out.shape[-1] != head_dim else out


class TargetAttention(TorchFunctionMode):
    """Run every ``F.scaled_dot_product_attention`` call as ``target``'s dispatcher would
    (module docstring); ``chosen`` records each distinct (kernel, call, why)."""

    def __init__(self, target: DeviceProfile) -> None:
        super().__init__()
        self.target = target
        self.chosen: dict[tuple[str, str], str] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        b = _bind(args, kwargs)
        q, k, v = b["query"], b["key"], b["value"]
        call = AttentionCall(
            dtype=q.dtype,
            head_dim=q.shape[-1],
            value_head_dim=v.shape[-1],
            has_mask=b["attn_mask"] is not None,
            dropout_p=float(b["dropout_p"]),
            is_causal=bool(b["is_causal"]),
            grouped_query=k.shape[-3] != q.shape[-3],
            square=q.shape[-2] == k.shape[-2],
        )
        if self.target.kernels == "cpu":
            rest = {n: b[n] for n in ("dropout_p", "is_causal", "scale", "enable_gqa")}
            backend = cpu_backend((q, k, v, b["attn_mask"]), **rest)
            why = "as torch dispatches it on the CPU"
        else:
            backend, why = cuda_backend(call, self.target.compute_capability)
        self.chosen.setdefault((backend, call.describe()), why)
        return _run(backend, b, self.target.kernels)

    def summary(self) -> str:
        """One line per distinct choice: ``flash (bfloat16, head dim 128, ...): why``."""
        return "; ".join(f"{k} ({call}): {why}" for (k, call), why in self.chosen.items())


def prices_other_kernels(target: DeviceProfile, model_device: torch.device) -> bool:
    """Whether a model on ``model_device`` runs other attention kernels than ``target`` does
    (then :class:`TargetAttention` prices the target's)."""
    return model_device.type != target.kernels
