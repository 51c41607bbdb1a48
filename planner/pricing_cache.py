"""Priced models kept for reuse: a plan prices its model's step once (a fake-tensor trace, the
calibration's times); a later plan of the same model and input shapes in this process (another
budget, solver or objective) reuses that pricing (:func:`reuse_priced`, keyed by
:func:`pricing_key`).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from planner.calibration import Calibration, is_distributed

# (pricing_key) -> (the model, held weakly; its pricing), for the last PRICED_KEEP models
_PRICED: dict[tuple, tuple[Any, Any]] = {}
PRICED_KEEP = 8


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        # integer and boolean inputs (token ids, masks) steer the path the model takes
        # (transformers skips an all-ones mask), so their values are part of the key
        values = (
            hash(x.detach().cpu().numpy().tobytes())
            if not x.is_floating_point() and x.device.type != "meta" and x.numel() <= 1 << 20
            else None
        )
        return (tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.requires_grad, values)
    return x if isinstance(x, (int, float, bool, str, type(None))) else ("id", id(x))


def pricing_key(
    model: torch.nn.Module, example_input: Any, pinned: Calibration | str | Path | None, *extra: Any
) -> tuple | None:
    """What a model's pricing depends on: the model (its module tree, parameters' and buffers'
    shapes and dtypes, wrapped forwards, training mode), the input's shapes, the calibration,
    autocast and ``extra`` (loss function, device profile, form...). None under
    ``torch.distributed``, where every rank prices (a collective) rather than some reusing."""
    if is_distributed():
        return None
    leaves, spec = tree_flatten(example_input)
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    state = tuple((name, tuple(t.shape), t.dtype, t.device, t.requires_grad) for name, t in tensors)
    modules = tuple(
        (path, type(m).__name__, m.training, "forward" in m.__dict__)
        for path, m in model.named_modules()
    )
    if isinstance(pinned, Calibration):
        calibration: Any = ("object", id(pinned))
    elif pinned is not None:
        calibration = ("path", str(Path(pinned).resolve()))
    else:
        calibration = None
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
    )
    return (
        id(model),
        modules,
        state,
        str(spec),
        tuple(_spec(x) for x in leaves),
        calibration,
        autocast,
        torch.get_num_threads(),
        *extra,
    )


def reuse_priced(key: tuple | None, model: torch.nn.Module, make: Any) -> Any:
    """``make()``'s pricing of ``model``, or the one made earlier for the same ``key``."""
    if key is None:
        return make()
    found = _PRICED.get(key)
    if found is not None and found[0]() is model:
        return found[1]
    priced = make()
    _PRICED.pop(key, None)
    _PRICED[key] = (weakref.ref(model), priced)
    while len(_PRICED) > PRICED_KEEP:
        _PRICED.pop(next(iter(_PRICED)))
    return priced
