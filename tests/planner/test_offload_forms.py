"""Offload regions carried out (passes/offload.py, simulate's Rule 7), in both forms, on the
CPU with the host taken for another memory than the device's (``host_apart``), so that what a
region sends goes through the copy to host and back that CUDA makes (without its streams).

- Both forms send exactly the storages the memory model prices: each storage made inside the
  region and saved for backward, once (the host holds their bytes, no more; their count is
  what the region's bookkeeping is priced by), and no parameter and no region input; the
  gradients are bitwise the model's own (dropout included). The graph form ran its regions
  under ``save_on_cpu`` before, which sent every saved tensor (parameters and inputs too): on
  CUDA its plans measured 4-19% below their predictions.
- An in-place plan's offloaded block compiled by inductor: the saved tensors come back with
  the strides its backward asserts (a permuted view came back contiguous and failed
  ``assert_size_stride``), the gradients are eager's within inductor's tolerance, and dynamo
  compiles the block's code but nothing of passes/offload.py (it recompiled the storage ids of
  the block's parameters for each dtype until its recompile limit).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from benchmarks.models import GPTConfig, gpt_example
from planner.graph_form import price
from planner.inplace_form import build_inplace_plan, price_inplace
from planner.passes import offload
from planner.passes.rewrite import CheckpointRegion
from planner.solvers.costgraph import Region, Schedule
from tests.cuda.common import assert_close_step_copy
from tests.helpers import assert_same_step, assert_same_step_copy

SMALL = GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=32, vocab_size=64)
BLOCK = "blocks.1"


@pytest.fixture
def sending(monkeypatch):
    monkeypatch.setattr(offload, "host_apart", lambda device: True)


def _in_block(path: str) -> bool:
    return path == BLOCK or path.startswith(BLOCK + ".")


def _graph_plan(model: nn.Module, example_input):
    """A graph plan offloading ``BLOCK``'s nodes, nothing else; the region's module."""
    priced = price(model, example_input)
    nodes = [i for i, n in enumerate(priced.graph.nodes) if _in_block(n.module_path)]
    region = Region(nodes[0], nodes[-1] + 1, 0, "offload")
    p = priced.build(Schedule((region,), "manual"), 10**12)
    (runner,) = [m for m in p.module.children() if isinstance(m, CheckpointRegion)]
    return p, runner


def _inplace_plan(model: nn.Module, example_input):
    """An in-place plan offloading ``BLOCK``, nothing else; the block."""
    eg = price_inplace(model, example_input)
    spans = {path: span for span, path in eg.spans.items()}
    region = Region(*spans[BLOCK], 0, "offload")
    p = build_inplace_plan(model, eg, Schedule((region,), "manual"), 10**12)
    return p, model.get_submodule(BLOCK)


@pytest.mark.parametrize("form", ["graph", "inplace"])
def test_an_offload_region_sends_what_rule_7_prices(form, sending, monkeypatch):
    model, x = gpt_example(SMALL, batch=2)
    reference = copy.deepcopy(model)
    p, runner = (_graph_plan if form == "graph" else _inplace_plan)(model, x)
    assert [r.kind for r in p.regions] == ["offload"]
    inputs: list[torch.Tensor] = []
    runner.register_forward_pre_hook(lambda _, args: inputs.extend(args))
    calls, sent, kept = set(), [], []
    pack = offload._Call.pack

    def spy(call, t):
        calls.add(call)
        packed = pack(call, t)
        (sent if isinstance(packed, offload._Sent) else kept).append(t)
        return packed

    monkeypatch.setattr(offload._Call, "pack", spy)
    if form == "graph":
        assert_same_step(model, p.module, x)
    else:
        p.apply(model)
        assert_same_step_copy(reference, model, x)

    def storages(ts) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}

    outside = storages([*model.parameters(), *inputs])
    assert kept and storages(kept).keys() <= outside.keys()  # weights, the block's input
    assert not storages(sent).keys() & outside.keys()
    assert sum(storages(sent).values()) == p.simulation.offload_bytes > 0
    # each of them went to host once
    assert sum(s.host.nbytes for call in calls for s in call.sent) == p.simulation.offload_bytes
    # and the region's bookkeeping is priced per storage sent (CostGraph.checkpoint_overhead_s)
    (region,) = p.schedule.regions
    sends = sum(len(call.sent) for call in calls)
    assert sends == p.graph.offloaded_storages(region.start, region.stop) > 1


@pytest.mark.slow
def test_an_offloaded_block_compiles(sending, monkeypatch):
    torch._dynamo.reset()
    # Dropout off: inductor draws its own random numbers, not eager's.
    model, x = gpt_example(replace(SMALL, dropout=0.0), batch=2)
    reference = copy.deepcopy(model)
    p, _ = _inplace_plan(model, x)
    saved = []
    init = offload._Sent.__init__
    monkeypatch.setattr(offload._Sent, "__init__", lambda s, *a: saved.append(a[1]) or init(s, *a))
    p.apply(model)
    for block in model.blocks:
        block.compile(backend="inductor")
    try:
        for seed in (0, 1):  # the second step runs the cached code
            assert_close_step_copy(reference, model, x, seed, rtol=1e-3, atol=1e-5)
        assert any(not t.is_contiguous() for t in saved)  # saved by the compiled forward
        helpers = (offload.offloaded_call, offload._kept, offload._storage_id)
        helpers += (offload._Call.pack, offload._Call.unpack)
        for f in helpers:
            assert not _debug_get_cache_entry_list(inspect.unwrap(f).__code__), f
    finally:
        torch._dynamo.reset()
