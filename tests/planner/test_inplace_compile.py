"""In-place plans under torch.compile (issue 21): selective regions compile without graph breaks,
and the ops they keep reach AOT autograd's partitioner as MUST_SAVE.

A tiny Hugging Face Llama (4 layers, width 64, grouped-query attention, batch 4 x 64 with one
padded row, ``use_cache=False``) planned in place at half its eager peak holds selective regions
next to plain ones. Before: the selective policy was an object dynamo cannot make a constant of,
so each selective region graph-broke twice ("Failed to convert UserDefinedObjectVariable(_Policy)
into a Python constant") and ran eager, silently.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy

import planner
from benchmarks.compiled_inplace import gpt2, llama, tokens
from planner.compiled import COMPILED_MARGIN, compiled_budget_bytes
from planner.devices import profile_of_model
from planner.inplace import ModuleRegion, apply_regions
from tests.helpers import assert_same_step_copy, step

pytestmark = pytest.mark.slow


@functools.cache
def eager_peak_bytes(name: str) -> int:
    return planner.measure({"llama": llama, "gpt2": gpt2}[name](), tokens()).peak_bytes


# Roofline prices of fixed rates: the same plan on every run and every machine. The "cpu"
# profile's rates are this machine's (a microbenchmark), and on a machine of this kind whose
# FLOP/s stood 6 times its bytes/s dp kept no matmul at half the eager peak.
PINNED = planner.DeviceProfile("cpu, pinned", 100e9, 40e9, 40e9, host_link=False)


@functools.cache
def planned(
    name: str = "llama", share: float = 0.5, compiled: bool = False
) -> tuple[nn.Module, planner.InplacePlan]:
    """A model (not applied) and its in-place plan at ``share`` of its measured eager peak,
    priced by the PINNED roofline."""
    model = {"llama": llama, "gpt2": gpt2}[name]()
    budget_gb = eager_peak_bytes(name) * share / 1e9
    p = planner.plan(model, tokens(), budget_gb, form="inplace", device=PINNED, compiled=compiled)
    return model, p


def applied(
    name: str = "llama", share: float = 0.5, compiled: bool = False
) -> tuple[nn.Module, nn.Module, planner.InplacePlan]:
    """(a fresh copy with the plan applied, an untouched copy, the plan)."""
    model, p = planned(name, share, compiled)
    reference = copy.deepcopy(model)
    return p.apply(copy.deepcopy(model)), reference, p


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def selective(p: planner.InplacePlan) -> list[ModuleRegion]:
    regions = [r for r in p.module_regions if r.kind == "selective"]
    assert regions, "half the eager peak should plan selective regions"
    return regions


def compiled_graphs(model: nn.Module, example: dict) -> list[torch.fx.GraphModule]:
    """The forward and backward graphs AOT autograd makes of one compiled step (inductor's
    decompositions and min-cut partitioner; the graphs run eagerly). No graph break allowed."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import select_decomp_table

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=keep,
        bw_compiler=keep,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )
    torch._dynamo.reset()
    counters.clear()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        step(torch.compile(model, backend=backend), example, list(model.parameters()))
    assert graph_breaks() == 0, dict(counters["graph_break"])
    assert len(graphs) == 2  # one forward, one backward: the whole model in one graph
    return graphs


def count(gm: torch.fx.GraphModule, op: Any, tag: CheckpointPolicy | None = None) -> int:
    """``op`` nodes of ``gm`` (with the partitioner's ``recompute`` tag ``tag``, if given)."""
    return sum(
        n.target is op and (tag is None or n.meta.get("recompute") == tag) for n in gm.graph.nodes
    )


MM, ADDMM = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
MUST_SAVE = CheckpointPolicy.MUST_SAVE


def test_selective_regions_reach_the_partitioner_without_graph_breaks():
    """Whole model: 0 graph breaks; in the forward graph the partitioner gets, exactly the
    planned keeps' matmuls are tagged MUST_SAVE, and the backward recomputes fewer matmuls than
    the same regions without keeps."""
    model, _, p = applied()
    kept_mm = sum(op == "aten.mm.default" for r in selective(p) for op, _ in r.keeps)
    assert kept_mm > 0
    forward, backward = compiled_graphs(model, tokens())
    assert count(forward, MM, MUST_SAVE) == kept_mm

    plain = tuple(dataclasses.replace(r, kind="recompute", keeps=()) for r in p.module_regions)
    apply_regions(model, plain)
    plain_forward, plain_backward = compiled_graphs(model, tokens())
    assert count(plain_forward, MM, MUST_SAVE) == 0
    # every kept matmul that backward reads is not recomputed; a region's last linear (o_proj,
    # down_proj) may feed only the residual add, which backward needs neither kept nor rerun
    saved_mm = count(plain_backward, MM) - count(backward, MM)
    assert kept_mm - len(selective(p)) <= saved_mm <= kept_mm, (saved_mm, kept_mm)


def test_gpt2_with_dropout_keeps_its_planned_ops_under_compile():
    """AOT autograd's trace names ops otherwise than eager CPU dispatch (one native_dropout for
    four ops, view for _unsafe_view): the planned sequence is translated, so GPT-2's selective
    regions (dropout 0.1) do not diverge under compile and their kept addmms are MUST_SAVE (it
    used to warn of divergence at op 24 and recompute everything after it)."""
    model, _, p = applied("gpt2")
    kept = sum(op == "aten.addmm.default" for r in selective(p) for op, _ in r.keeps)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran other operations than planned")
        forward, _ = compiled_graphs(model, tokens())
    assert kept > 0 and count(forward, ADDMM, MUST_SAVE) == kept


def _compile_layers(model: nn.Module, backend: str) -> None:
    for layer in model.model.layers:  # in place: paths and state_dict keys stay the model's
        layer.compile(backend=backend)


def _layer_plan(layer: nn.Module) -> tuple:
    """The wrapped modules of ``layer`` (relative paths), each with its kind and, selective, its
    decisions' key: what dynamo's guards see of the plan."""
    plan = []
    for path, module in layer.named_modules():
        if (own := module.__dict__.get("forward")) is None:
            continue
        w = own.__func__
        if not hasattr(w, "region"):  # its own forward's spans (planner/inplace.py _ParentSpans)
            plan.append((path, "spans", tuple(r.name for r in w.regions)))
        else:
            plan.append((path, w.region.kind, w.key if w.region.kind == "selective" else None))
    return tuple(plan)


def test_per_block_aot_eager_no_graph_breaks_bitwise_and_within_budget():
    """torchtitan's order (plan, apply, compile per block): 0 graph breaks, bitwise the
    gradients of the unwrapped model, the compiled peak (profiler) within the budget."""
    model, reference, p = applied()
    torch._dynamo.reset()
    counters.clear()
    _compile_layers(model, "aot_eager")
    for seed in (0, 1):  # the second step runs the cached compiled code
        assert_same_step_copy(reference, model, tokens(), seed=seed)
    assert graph_breaks() == 0, dict(counters["graph_break"])
    # blocks planned alike share compiled code: as many graphs as distinct layer plans
    plans = {_layer_plan(layer) for layer in model.model.layers}
    assert len(plans) < len(model.model.layers)
    assert counters["stats"]["unique_graphs"] == len(plans)
    measured = planner.measure(model, tokens(), method="profiler")
    assert measured.peak_bytes <= p.budget_bytes, (measured.peak_bytes, p.budget_bytes)


def test_blocks_planned_differently_compile_per_block_without_graph_breaks():
    """GPT-2's half-eager plan with its blocks' selective regions keeping different ops:
    compiled per block, each such block used to graph-break once (its int key, guarded as a
    SymInt on the recompile, could not be a constant in context_fn) and then warned of
    divergence (its dropout traced with dynamic shapes). Now: 0 breaks, no warning."""
    from benchmarks.compiled_inplace import compiled_peak

    model, p = planned("gpt2")
    # blocks planned differently: the plan's regions, the first selective one keeping one op
    # fewer (whatever keeps the solver picks, at least two blocks then differ)
    regions = list(p.module_regions)
    first = next(i for i, r in enumerate(regions) if r.kind == "selective")
    regions[first] = dataclasses.replace(regions[first], keeps=regions[first].keeps[:-1])
    model = apply_regions(copy.deepcopy(model), tuple(regions))
    assert len({r.keeps for r in regions if r.kind == "selective"}) > 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran other operations than planned")
        _, breaks = compiled_peak("gpt2", model, tokens(), "block", "aot_eager")
    assert breaks == 0, dict(counters["graph_break"])


def test_whole_model_inductor_no_graph_breaks_and_within_budget():
    model, reference, p = applied()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)  # inductor (CPU: a C++ compiler)
    loss_a, grads_a = step(reference, tokens(), list(reference.parameters()))
    loss_b, grads_b = step(compiled, tokens(), list(model.parameters()))
    assert graph_breaks() == 0, dict(counters["graph_break"])
    torch.testing.assert_close(loss_b, loss_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)
    measured = planner.measure(compiled, tokens())  # the profiler's allocation events
    assert measured.method == "profiler"
    assert measured.peak_bytes <= p.budget_bytes, (measured.peak_bytes, p.budget_bytes)


class _Branchy(nn.Module):
    """``extra`` adds an op the plan never saw."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.extra:
            h = h * 2
        return torch.relu(h) + torch.tanh(h)


def test_divergence_is_detected_while_compiling():
    """The compiled path asks the eager policy while AOT autograd traces the region: a region
    whose ops differ from the plan warns once, at compile time, and still trains bitwise."""
    from planner.passes.eager import eager_graph

    torch.manual_seed(0)
    model = nn.Sequential(_Branchy(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    eg = eager_graph(model, x, rates=profile_of_model(model))
    (start, stop) = next(s for s, path in eg.spans.items() if path == "0")
    keep = next(i for i in range(start, stop) if "addmm" in eg.graph.nodes[i].op)
    region = ModuleRegion(
        "0", "selective", 0, (eg.op_key(keep, start),), tuple(eg.op_sequence(start, stop))
    )
    model[0].extra = True
    reference = copy.deepcopy(model)
    apply_regions(model, (region,))
    torch._dynamo.reset()
    counters.clear()
    model.compile(backend="aot_eager")
    with pytest.warns(UserWarning, match="module '0' ran other operations than planned"):
        assert_same_step_copy(reference, model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module
        assert_same_step_copy(reference, model, x)
    assert graph_breaks() == 0


def test_compiled_plan_is_flat_within_its_stated_margin():
    """plan(compiled=True): no nested regions (compile flattens them: the eager plan at 30% of
    the Llama's eager peak nests, and compiled it measured 1.18-1.41x its budget), the eager
    prediction within the budget less the margin, the margin stated in the summary and the
    solver note; a budget only nesting reaches is refused with the least compiled budget."""
    _, eager_plan = planned("llama", 0.3)
    assert any(r.depth for r in eager_plan.regions)
    _, p = planned("llama", 0.45, compiled=True)
    assert p.regions and not any(r.depth for r in p.regions)
    assert p.compiled_margin == COMPILED_MARGIN > 0
    assert p.predicted_peak_bytes <= compiled_budget_bytes(p.budget_bytes) < p.budget_bytes
    assert f"{COMPILED_MARGIN:.0%} margin" in p.summary()
    assert p.schedule.note.startswith("compiled: planned without nested regions")
    with pytest.raises(planner.InfeasibleBudgetError, match="compiled=True") as e:
        planned("llama", 0.3, compiled=True)
    # stated in the caller's budget: a compiled plan at (just above) the least it names fits
    assert e.value.budget_bytes == eager_plan.budget_bytes < e.value.min_bytes
    least_share = e.value.min_bytes * 1.001 / eager_peak_bytes("llama")
    _, least = planned("llama", least_share, compiled=True)
    assert least.predicted_peak_bytes <= compiled_budget_bytes(least.budget_bytes)


@pytest.mark.parametrize("scope", ["whole", "block"])
def test_compiled_plan_measures_within_budget(scope):
    """The Llama planned with compiled=True at 45% of its eager peak (the least such a plan
    reaches is about 40%), compiled whole with aot_eager and inductor (whole) or per block
    with aot_eager: 0 graph breaks, and the compiled step's measured peak within the budget."""
    from benchmarks.compiled_inplace import compiled_peak

    model, p = planned("llama", 0.45, compiled=True)
    for backend in ["aot_eager", "inductor"] if scope == "whole" else ["aot_eager"]:
        compiled = p.apply(copy.deepcopy(model))
        peak_bytes, breaks = compiled_peak("llama", compiled, tokens(), scope, backend)
        assert breaks == 0, (backend, dict(counters["graph_break"]))
        assert peak_bytes <= p.budget_bytes, (backend, peak_bytes, p.budget_bytes)
