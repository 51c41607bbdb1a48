"""Transformers' attention-mask decisions, taken on the real example input while the step runs
on fake tensors (:func:`mask_decisions_as_eager`): the priced step takes the attention path
eager takes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from planner.passes.trace import is_tensor


class _AllOnes(TorchFunctionMode):
    """Remembers the tensors made while it is active that hold only ones, values a fake tensor
    cannot show: ``torch.ones`` and the like, and casts, views and selections of them."""

    MAKE = (torch.ones, torch.ones_like, torch.Tensor.new_ones)
    KEEP = (torch.Tensor.to, torch.Tensor.bool, torch.Tensor.__getitem__, torch.Tensor.view,
            torch.Tensor.reshape, torch.Tensor.expand)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weak: pricing sees every free

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = func in self.MAKE or (func in self.KEEP and args[0] in self.made)
        if made and isinstance(out, torch.Tensor):
            self.made[out] = True
        return out


@contextmanager
def mask_decisions_as_eager(kwargs: dict[str, Any]) -> Iterator[None]:
    """Let transformers take the attention path eager takes, which it decides from values.

    Before building an attention mask, transformers asks whether the position ids pack several
    sequences in a row (``find_packed_sequence_indices``) and whether a padding mask is all
    ones (``_ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa``); only if neither
    needs a mask does SDPA run without one (``is_causal``, the flash kernel). On fake tensors it
    cannot read values, so it always builds the (batch, 1, S, S) mask and SDPA takes the masked
    path: the priced step held up to 16% more than eager's on decoders called without a mask.
    Here the answers come from the real example input instead, where they are certain:

    - packed sequences: from the caller's real ``position_ids``; without them transformers
      numbers each row 0..S-1 itself, which never packs;
    - a padding mask the caller passed (keys naming a ``mask``): every one all ones means no
      token is masked, as eager sees it.

    - a padding mask the model makes itself: all ones when it is ``torch.ones`` or a cast, view
      or selection of it (Bart's decoder makes one when called without a decoder mask, and eager
      then takes the unmasked path; priced masked, a selective region's op keys no longer
      matched eager's ops and plans were over-predicted by up to 17%). Any other mask the model
      makes is left to transformers' fake-tensor answer: a mask, on the safe side.

    Nothing changes if transformers was not imported or lacks these functions.
    """
    import sys

    mu = sys.modules.get("transformers.masking_utils")
    names = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa")
    if mu is None or not all(hasattr(mu, n) for n in names):
        yield
        return
    positions = kwargs.get("position_ids")
    packed = (
        is_tensor(positions)
        and not positions.is_meta  # values unknown: rows numbered 0..S-1, as transformers does
        and mu.find_packed_sequence_indices(positions) is not None
    )
    masks = [v for k, v in kwargs.items() if "mask" in k and is_tensor(v)]
    # a mask on the meta device has no values: priced padded, the masked path (summary says)
    unmasked = bool(masks) and all(not m.is_meta and bool(m.all()) for m in masks)
    optional = ("_ignore_bidirectional_mask_sdpa",)
    originals = {n: getattr(mu, n) for n in (*names, *optional) if hasattr(mu, n)}

    def find_packed(position_ids: Any) -> Any:
        if isinstance(position_ids, FakeTensor) and not packed:
            return None
        return originals["find_packed_sequence_indices"](position_ids)

    ones = _AllOnes()

    def ignore_mask(name: str) -> Callable[..., bool]:
        def ignore(padding_mask: Any, *args: Any, **kw: Any) -> bool:
            if isinstance(padding_mask, FakeTensor) and (unmasked or padding_mask in ones.made):
                padding_mask = None
            return originals[name](padding_mask, *args, **kw)

        return ignore

    patched = {
        "find_packed_sequence_indices": find_packed,
        **{n: ignore_mask(n) for n in originals if n != "find_packed_sequence_indices"},
    }
    try:
        for n, f in patched.items():
            setattr(mu, n, f)
        with ones:
            yield
    finally:
        for n, f in originals.items():
            setattr(mu, n, f)
