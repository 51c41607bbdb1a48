"""passes/offload.py on the CPU, with the host taken for another memory than the device's
(``host_apart``), so that what a region makes and saves goes through the copies to host and
back that CUDA makes (without its streams):

- each saved tensor comes back as the same view (size, strides, storage offset, dtype) with
  the same values (a torch.compile-d backward asserts the strides of what it saved), whatever
  its layout: transposed, permuted, a slice with gaps, expanded;
- a storage goes to host once however many views of it are saved, and comes back once for the
  views a backward unpacks together (Rule 7 prices storages);
- a storage is sent again when another storage takes its address in the call, or when it is
  written in place after it was sent;
- parameters and arguments stay;

and the gradients are bitwise those of the call without offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.passes import offload


@pytest.fixture
def sending(monkeypatch):
    monkeypatch.setattr(offload, "host_apart", lambda device: True)


@pytest.fixture
def spied(monkeypatch):
    """What the hooks saw: the calls, and each tensor packed, sent or not."""
    seen = {"calls": [], "kept": [], "sent": {}, "back": []}
    pack, unpack = offload._Call.pack, offload._Call.unpack

    def spy_pack(call, t):
        if call not in seen["calls"]:
            seen["calls"].append(call)
        packed = pack(call, t)
        if isinstance(packed, offload._Sent):
            seen["sent"][id(packed)] = _layout(t)
        else:
            seen["kept"].append(t)
        return packed

    def spy_unpack(call, packed):
        t = unpack(call, packed)
        if isinstance(packed, offload._Sent):  # not t itself: that would keep it alive
            seen["back"].append((id(packed), _layout(t), t.untyped_storage().data_ptr()))
        return t

    monkeypatch.setattr(offload._Call, "pack", spy_pack)
    monkeypatch.setattr(offload._Call, "unpack", spy_unpack)
    return seen


def _layout(t: torch.Tensor) -> tuple:
    return t.size(), t.stride(), t.storage_offset(), t.dtype, t.detach().clone()


def host_bytes(seen) -> int:
    return sum(s.host.nbytes for call in seen["calls"] for s in call.sent)


def gradients(run, x: torch.Tensor, module: nn.Module) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    run(x).backward()
    grads = [x.grad, *(p.grad for p in module.parameters())]
    module.zero_grad(set_to_none=True)
    return grads


def assert_offloaded_gradients(module: nn.Module, x: torch.Tensor, reference=None) -> None:
    """``module`` offloaded gives bitwise the gradients of ``reference`` (``module``) plain."""
    offloaded = gradients(lambda a: offload.offloaded_call(module, module, a), x, module)
    plain = gradients(reference or module, x, module)
    for a, b in zip(offloaded, plain, strict=True):
        assert torch.equal(a, b)


class Views(nn.Module):
    """Saves views of an activation it makes: transposed, permuted, strided with gaps, expanded."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w)  # (4, 6, 8), made here; tanh saves it
        t = h.transpose(1, 2)  # bmm saves it
        p = h.permute(2, 0, 1)  # sin and mul save it
        g = h[:, 1::2]  # a slice with gaps, at an offset
        e = h[:, :1].expand(4, 6, 8)  # stride 0
        return torch.bmm(t, h).sum() + (p * p.sin()).sum() + (g * g).sum() + (e * h).sum()


def test_saved_views_come_back_as_they_were(sending, spied):
    torch.manual_seed(0)
    module, x = Views(), torch.randn(4, 6, 8)
    assert_offloaded_gradients(module, x)
    back = []
    for key, (*layout, value), _ in spied["back"]:
        *packed, packed_value = spied["sent"][key]
        assert layout == packed and torch.equal(value, packed_value)
        back.append((layout[1], layout[2]))
    for view in (((48, 1, 8), 0), ((1, 48, 8), 0), ((48, 16, 1), 8), ((48, 0, 1), 0)):
        assert view in back, (view, back)
    assert len(spied["back"]) == len(spied["sent"])
    # h and p.sin(), each once (h: saved through six views)
    assert host_bytes(spied) == 2 * 4 * 6 * 8 * 4


def test_views_of_one_storage_go_and_come_back_as_one(sending, spied):
    """q * k saves two views of one qkv storage (a slice each, with gaps): it goes to host
    once, whole, and comes back once for the backward that unpacks both."""

    class QK(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, _ = x.repeat(1, 1, 3).split(8, dim=-1)  # (4, 6, 24): made here
            return (q * k).sum()

    module, x = QK(), torch.randn(4, 6, 8)
    assert_offloaded_gradients(module, x)
    assert len(spied["sent"]) == 2 and host_bytes(spied) == 4 * 6 * 24 * 4
    (_, _, q), (_, _, k) = spied["back"]
    (call,) = spied["calls"]
    assert q == k and q != call.sent[0].host.data_ptr()  # one copy back


def test_another_storage_at_an_address_sent_from_is_sent_again(sending, spied):
    """The allocator may give a storage freed in the call (sent, nothing else held it) to a new
    one: an address is not a storage. Here, deterministically, two storages over one buffer."""

    class SameAddress(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            buffer = bytearray(x.nbytes)
            a = torch.frombuffer(buffer, dtype=x.dtype).view(x.shape).copy_(x * 2)
            y = a.sin()  # saves a
            b = torch.frombuffer(buffer, dtype=x.dtype).view(x.shape).copy_(x * 3)
            return (y + b.sin()).sum()  # saves b, at a's address

    def reference(x: torch.Tensor) -> torch.Tensor:
        return ((x * 2).sin() + (x * 3).sin()).sum()

    module, x = SameAddress(), torch.randn(16, 16)
    assert_offloaded_gradients(module, x, reference)
    assert host_bytes(spied) == 2 * 16 * 16 * 4


def test_a_storage_written_after_it_was_sent_is_sent_again(sending, spied):
    class Written(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2
            y = h.sin()  # saves h
            h.mul_(3)
            return (y + h.sin()).sum()  # saves h again, written

    def reference(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return (h.sin() + (h * 3).sin()).sum()

    module, x = Written(), torch.randn(16, 16)
    assert_offloaded_gradients(module, x, reference)
    assert host_bytes(spied) == 2 * 16 * 16 * 4


def test_parameters_and_arguments_stay(sending, spied):
    """Only what the call makes is sent: a saved parameter, argument, or view of one is kept."""
    torch.manual_seed(0)
    module, x = Views(), torch.randn(4, 6, 8, requires_grad=True)
    offload.offloaded_call(module, module, x.transpose(1, 2).transpose(1, 2)).backward()
    storages = {t.untyped_storage().data_ptr() for t in spied["kept"]}
    assert storages == {x.untyped_storage().data_ptr(), module.w.untyped_storage().data_ptr()}
