"""Carry out an offload region (simulate's Rule 7): what a module call saves for backward waits
in host memory, and each storage comes back when the backward that needs it runs.

:func:`offloaded_call` runs one call of a region module under ``saved_tensors_hooks``. Only the
storages the call itself makes are sent (the memory model's offloaded bytes): its parameters,
buffers and arguments stay where they are, as they are alive on the device anyway. On CUDA a
saved activation is copied to pinned host memory on a side stream (so the copy overlaps the
call's remaining forward), and copied back on the compute stream when autograd unpacks it.
Copying back at the unpack, not ahead of it, keeps on the device exactly what Rule 7 prices:
bringing a whole region back as its backward started (measured on an H200, 2026-11-27) held
all of the region's storages at once, and took a plan priced at a third of eager's peak past
eager's. The copy back is exposed step time (Rule 7). On the CPU the host is the device: the
hooks run, nothing is copied, and the step computes exactly what it computes without them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class _Sent:
    """One saved tensor of one call, on the host."""

    __slots__ = ("device", "host", "ready")

    def __init__(self, device: torch.device, host: torch.Tensor, ready: Any) -> None:
        self.device = device
        self.host = host
        self.ready = ready  # a CUDA event: the copy to host has finished


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

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        torch.cuda.current_stream(packed.device).wait_event(packed.ready)
        # a second unpack (retain_graph) copies it back again
        return packed.host.to(packed.device, non_blocking=True)


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
    return out
