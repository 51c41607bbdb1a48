"""Storages a real kernel leaves larger than its fake kernel shows.

``mse_loss``, ``smooth_l1_loss``, ``binary_cross_entropy`` and ``soft_margin_loss`` reduced
(``mean`` or ``sum``) compute the unreduced loss into their output and then shrink the output
to a scalar: the 0-d loss keeps the whole storage, one input-sized tensor, for as long as it
lives, and a training step holds its loss through backward. Their fake and meta kernels return
a scalar's storage. The other losses with a ``reduction`` argument return a fresh scalar (seen on
torch 2.13's CPU kernels: ``tests/passes/test_kernel_storages.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

_REDUCTION_NONE, _REDUCTION_MEAN = 0, 1  # at::Reduction

_SHRUNK_LOSSES = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mse_loss", "smooth_l1_loss", "binary_cross_entropy", "soft_margin_loss")
)


def real_storage_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """The bytes of the storage the real kernel of ``func`` returns on ``args``, where its fake
    kernel returns a smaller one; None for every other call."""
    if func not in _SHRUNK_LOSSES:
        return None
    values = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    if values.get("reduction", _REDUCTION_MEAN) == _REDUCTION_NONE:
        return None
    loss, target = values["self"], values["target"]
    return math.prod(torch.broadcast_shapes(loss.shape, target.shape)) * loss.element_size()
