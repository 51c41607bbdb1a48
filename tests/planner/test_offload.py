"""Offload as a solver choice (simulate's Rule 7): taken where the device has a host link and
the transfer (out hidden behind the region's forward, back exposed) costs less than
recomputing the region, never on a CPU.

- A reduced Llama-7B shape (4 layers, 32k tokens, flash attention, meta device, FSDP2 on 8
  ranks) on the H100 profile, the attention modules its only candidate regions, at the budget
  that recomputing them all reaches: auto offloads them (32k tokens of attention take longer to
  recompute than their saves take to copy back), the step is faster than with them recomputed,
  and ``summary()`` says why (transfer time < recompute time). Over every module, at budgets
  above that, recomputing MLPs is cheaper still, and the solvers rightly take that.
- GPT-ref on the CPU profile (host memory is the device's): never offloaded, whatever the budget.
- ilp alone on a 2-layer shape (one process): it offloads the attention modules too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import planner
from benchmarks.models import GPTConfig, gpt_example
from benchmarks.plan_7b import LlamaConfig, llama_example
from planner.devices import device_profile
from planner.fsdp import FSDPConfig
from planner.inplace_form import build_inplace_plan, price_inplace
from planner.report import format_bytes, format_ms
from planner.solvers.costgraph import Region, Schedule
from planner.solvers.registry import get_solver
from planner.solvers.simulate import simulate

LAYERS, SEQ = 4, 32768


def _attention_only(eg, layers: int):
    """``eg``'s graph with the attention modules its only candidate regions, and the budget
    every one of them recomputed reaches."""
    spans = frozenset(eg.module_spans[f"layers.{i}.self_attn"] for i in range(layers))
    graph = replace(eg.graph, region_spans=spans)
    budget = simulate(graph, Schedule(tuple(Region(*s) for s in sorted(spans)))).peak_bytes
    return graph, budget


def _llama_plan():
    cfg = LlamaConfig(n_layer=LAYERS, seq_len=SEQ, attention="sdpa")
    model, example = llama_example(cfg)
    eg = price_inplace(model, example, device=device_profile("h100"), fsdp=FSDPConfig(8))
    graph, budget = _attention_only(eg, LAYERS)
    eg = replace(eg, graph=graph)
    return eg, build_inplace_plan(model, eg, get_solver("auto")(graph, budget), budget)


def test_llama_7b_shape_at_32k_offloads_its_attention_on_h100():
    eg, p = _llama_plan()
    assert eg.graph.host_link and eg.graph.region_state_bytes == 0  # meta: an accelerator's
    offloaded = {r.name for r in p.regions if r.kind == "offload"}
    assert offloaded == {f"layers.{i}.self_attn" for i in range(LAYERS)}
    assert p.predicted_peak_bytes <= p.budget_bytes
    sim = p.simulation
    assert sim.offload_bytes > 0
    # Cheaper than recomputing them: the same plan with those regions recomputed instead.
    recomputed = Schedule(tuple(replace(r, kind="recompute") for r in p.schedule.regions))
    assert sim.step_time_s < simulate(eg.graph, recomputed).step_time_s
    text = p.summary()
    sent = dict(sim.offloaded)
    for region in p.schedule.regions:
        if region.kind == "offload":
            name = eg.spans[(region.start, region.stop)]
            assert f"{name} offloaded {format_bytes(sent[region])} to host: transfer " in text
    assert "< recompute" in text and format_ms(sim.offload_time_s) in text


@pytest.mark.parametrize("fraction", [0.4, 0.7])
def test_gpt_ref_on_the_cpu_profile_is_never_offloaded(fraction):
    model, x = gpt_example(GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=64, vocab_size=64))
    eager = planner.plan(
        model, x, 1e3, solver="none", device="cpu", form="graph"
    ).baseline_peak_bytes
    p = planner.plan(model, x, fraction * eager / 1e9, device="cpu", form="graph")
    assert not p.graph.host_link
    assert p.regions and not any(r.kind == "offload" for r in p.regions)
    assert p.simulation.offload_bytes == 0 and "to host" not in p.summary()


def test_ilp_offloads_the_attention_modules_on_h100_too():
    """ilp over the module spans of a 2-layer Llama-7B shape at 32k tokens (one process, H100
    profile): it offloads both attention modules, faster than its best plan without offload,
    the same whether its MILP starts from dp's schedule or not, on either backend."""
    cfg = LlamaConfig(n_layer=2, seq_len=SEQ, attention="sdpa")
    model, example = llama_example(cfg)
    eg = price_inplace(model, example, device=device_profile("h100"))
    graph, budget = _attention_only(eg, 2)
    ilp = get_solver("ilp")
    times_s = []
    for opts in ({}, {"warm": False}, {"warm": False, "backend": "cbc"}):
        schedule = ilp(graph, budget, **opts)
        offloaded = {eg.spans[(r.start, r.stop)] for r in schedule.regions if r.kind == "offload"}
        # the attention modules, alone or with the residual add after them (a span of each
        # layer's own forward, passes/parent_spans.py)
        attention = ({"layers.0.self_attn", "layers.1.self_attn"},)
        attention += ({"layers.0(self_attn..add)", "layers.1(self_attn..add)"},)
        assert offloaded in attention, (opts, schedule.regions)
        sim = simulate(graph, schedule)
        assert sim.peak_bytes <= budget
        times_s.append(sim.step_time_s)
    assert times_s == pytest.approx([times_s[0]] * 3, rel=1e-9)
    plain = simulate(graph, ilp(graph, budget, offload=False))
    assert plain.offload_bytes == 0 and times_s[0] < plain.step_time_s
