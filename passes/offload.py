"""Carry out an offload region (simulate's Rule 7): what a region's call saves for backward
waits in host memory, and each storage comes back when the backward that needs it runs.

Both forms run an offload region through :func:`offloaded_call`: the in-place form a module's
call (``planner/inplace.py``), the graph form a region's body (``passes/rewrite.py``
``CheckpointRegion``), so both carry out what Rule 7 prices. It runs one call under
``saved_tensors_hooks``. Only the storages the call itself makes are sent (the memory model's
offloaded bytes): the parameters and buffers of the module it runs, and its arguments, stay
where they are, as they are alive on the device anyway. On CUDA a saved activation's storage
is copied to pinned host memory on a side stream (so the copy overlaps the call's remaining
forward), and copied back on the compute stream when autograd unpacks it. Copying back at the
unpack, not ahead of it, keeps on the device exactly what Rule 7 prices: bringing a whole
region back as its backward started (measured on an H200, 2026-11-27) held all of the region's
storages at once, and took a plan priced at a third of eager's peak past eager's. The copy back
is exposed step time (Rule 7). On the CPU the host is the device: the hooks run, nothing is
copied, and the step computes exactly what it computes without them.

Storages, as Rule 7 prices them, not the saved tensors: a storage goes to host once, however
many views of it the call saves, and comes back once for the views unpacked while its copy back
is alive (attention saving q, k and v, three views of one qkv storage, brings that storage
back once). Each saved tensor comes back as the same view of it: its size, strides, storage
offset and dtype. Eager autograd takes any layout, but a torch.compile-d backward asserts the
strides of what its forward saved (a permuted view that came back contiguous failed inductor's
``assert_size_stride``).

Under torch.compile, dynamo compiles what the region runs, not this bookkeeping (storage ids,
streams, copies): :func:`offloaded_call` is skipped by dynamo, the frames it calls (the region's
body) are not, and the hooks and the storage ids are kept out of dynamo altogether
(``torch.compiler.disable``). Traced, the storage ids of a module's parameters and buffers
graph-broke and recompiled for each dtype until dynamo's recompile limit.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class _Stored:
    """One storage a call made and saved, whole, on the host; and its copy back on the device
    while a tensor unpacked from it is alive, so that the views of one storage come back as one
    storage (Rule 7 prices storages, not views)."""

    __slots__ = ("back", "device", "host", "ready", "source", "version")

    def __init__(
        self, storage: torch.UntypedStorage, version: int, host: torch.Tensor, ready: Any
    ) -> None:
        self.source = weakref.ref(storage)  # the device's storage, while it lives
        self.version = version  # its writes in place when it was sent
        self.device = storage.device
        self.host = host  # its bytes
        self.ready = ready  # a CUDA event: the copy to host has finished (None: no streams)
        self.back: weakref.ref | None = None

    def fetch(self) -> torch.UntypedStorage:
        storage = None if self.back is None else self.back()
        if storage is None:  # first unpacked, or what was unpacked is gone: copy back again
            if self.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(self.ready)
            # a copy even where the host is the device (the CPU, when tests send)
            back = self.host.to(self.device, non_blocking=True, copy=True)
            storage = back.untyped_storage()
            self.back = weakref.ref(storage)
        return storage


class _Sent:
    """One saved tensor of one call: its storage, on the host, and its view of it."""

    __slots__ = ("dtype", "offset", "size", "stored", "stride")

    def __init__(self, stored: _Stored, t: torch.Tensor) -> None:
        self.stored = stored
        self.dtype, self.offset = t.dtype, t.storage_offset()
        self.size, self.stride = t.size(), t.stride()

    def tensor(self) -> torch.Tensor:
        storage = self.stored.fetch()
        t = torch.empty(0, dtype=self.dtype, device=storage.device)
        return t.set_(storage, self.offset, self.size, self.stride)


class _Call:
    """The storages one call of an offload region sent to host."""

    def __init__(self, keep: set[int]) -> None:
        self.keep = keep  # storages alive outside the call: never sent
        self.sent: list[_Stored] = []
        self.latest: dict[int, _Stored] = {}  # by address: the storage sent from there last
        self.stream: Any = None

    @torch.compiler.disable
    def pack(self, t: torch.Tensor) -> Any:
        if not (host_apart(t.device) and _plain(t)):
            return t  # the host is the device (CPU)
        storage = t.untyped_storage()
        if storage.data_ptr() in self.keep:
            return t  # it lives on the device anyway
        stored = self.latest.get(storage.data_ptr())
        # Sent again when the address was freed in the call and taken by a new storage, or
        # when the storage was written in place since it was sent.
        if stored is None or stored.source() is not storage or stored.version != t._version:
            stored = self.send(t, storage)
        return _Sent(stored, t)

    def send(self, t: torch.Tensor, storage: torch.UntypedStorage) -> _Stored:
        if t.device.type != "cuda":  # a device without streams (the CPU, when tests send)
            stored = _Stored(storage, t._version, _host_copy(storage, pin=False), None)
        else:
            if self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host = _host_copy(storage, pin=True)
                ready = torch.cuda.Event()
                ready.record()
            t.record_stream(self.stream)  # the allocator keeps t until the copy is done
            stored = _Stored(storage, t._version, host, ready)
        self.sent.append(stored)
        self.latest[storage.data_ptr()] = stored
        return stored

    @torch.compiler.disable
    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.tensor()


def host_apart(device: torch.device) -> bool:
    """Whether the host's memory is another than ``device``'s: only then does sending free
    anything."""
    return device.type == "cuda"


def _plain(t: torch.Tensor) -> bool:
    """A strided tensor that its storage's bytes and its view of them make again (a lazy
    conjugate or negative view would lose its bit)."""
    return t.layout == torch.strided and not (t.is_conj() or t.is_neg())


def _host_copy(storage: torch.UntypedStorage, pin: bool) -> torch.Tensor:
    """``storage``'s bytes, copied to host memory."""
    device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
    return host.copy_(device_bytes, non_blocking=pin)


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)


@torch.compiler.disable
def _kept(module: torch.nn.Module, args: tuple[Any, ...]) -> set[int]:
    """The storages of ``module``'s parameters and buffers and of ``args``: alive on the device
    outside the call."""
    return {
        _storage_id(t)
        for t in (*module.parameters(), *module.buffers(), *tree_leaves(args))
        if isinstance(t, torch.Tensor)
    }


@torch.compiler.disable(recursive=False)
def offloaded_call(body: Callable[..., Any], module: torch.nn.Module, *args: Any) -> Any:
    """``body(*args)`` (one call of ``module``, or of a graph region's body) with what it saves
    for backward in host memory (module docstring)."""
    call = _Call(_kept(module, args))
    with torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
        return body(*args)
