"""Carry out an offload region (simulate's Rule 7): what a module call saves for backward waits
in host memory, and comes back before that call's backward needs it.

:func:`offloaded_call` runs one call of a region module under ``saved_tensors_hooks``. Only the
storages the call itself makes are sent (the memory model's offloaded bytes): its parameters,
buffers and arguments stay where they are, as they are alive on the device anyway. On CUDA a
saved activation is copied to pinned host memory on a side stream (so the copy overlaps the
call's remaining forward), and when the gradient of the call's outputs arrives, every one of its
offloaded tensors is copied back on that stream at once (prefetched: the copies overlap the
call's backward, and each unpack waits only for its own copy). On the CPU the host is the device:
the hooks run, nothing is copied, and the step computes exactly what it computes without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class _Sent:
    """One saved tensor of one call: on the host, and (once prefetched) back on the device."""

    __slots__ = ("device", "host", "back", "ready")

    def __init__(self, device: torch.device, host: torch.Tensor, ready: Any) -> None:
        self.device = device
        self.host = host
        self.back: torch.Tensor | None = None
        self.ready = ready  # a CUDA event: the last copy (to host, then back) has finished


class _Call:
    """The tensors one call of an offload region sent to host."""

    def __init__(self, keep: set[int]) -> None:
        self.keep = keep  # storages alive outside the call: never sent
        self.sent: list[_Sent] = []
        self.stream: Any = None

    def pack(self, t: torch.Tensor) -> Any:
        if t.device.type != "cuda" or _storage_id(t) in self.keep:
            return t  # the host is the device (CPU), or it lives on the device anyway
        if self.stream is None:
            self.stream = torch.cuda.Stream(t.device)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            host.copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        t.record_stream(self.stream)  # the allocator keeps t until the copy is done
        sent = _Sent(t.device, host, ready)
        self.sent.append(sent)
        return sent

    def prefetch(self) -> None:
        """Copy every sent tensor back, on the side stream (the call's backward is starting).

        Last sent first: backward unpacks in the reverse order of forward, so its first node
        waits for one copy, not for all of them, and the rest overlap its compute."""
        for sent in reversed(self.sent):
            if sent.back is None:
                self.stream.wait_event(sent.ready)
                with torch.cuda.stream(self.stream):
                    sent.back = sent.host.to(sent.device, non_blocking=True)
                    sent.ready = torch.cuda.Event()
                    sent.ready.record()

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.back is None:
            self.prefetch()
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(packed.ready)
        back = packed.back
        back.record_stream(current)
        packed.back = None  # a second unpack (retain_graph) copies it back again
        return back


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)


def offloaded_call(body: Callable[..., Any], module: torch.nn.Module, *args: Any) -> Any:
    """``body(*args)`` (one call of ``module``) with what it saves for backward in host memory
    (module docstring)."""
    keep = {
        _storage_id(t)
        for t in (*module.parameters(), *module.buffers(), *tree_leaves(args))
        if isinstance(t, torch.Tensor)
    }
    call = _Call(keep)
    with torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
        out = body(*args)
    if call.sent:  # the call's backward starts once any of its outputs has its gradient
        outputs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor) and x.requires_grad]
        torch.autograd.graph.register_multi_grad_hook(
            outputs, lambda _: call.prefetch(), mode="any"
        )
    return out
