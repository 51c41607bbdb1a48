"""Plans applied in place on the user's own modules (issue 11): same object, same gradients,
any shape up to the planned one, within budget, plain under eval/no_grad, undoable, saved and
re-applied, refused when they do not fit."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import planner
from benchmarks.models import GPTConfig, gpt_example
from planner import inplace
from planner.devices import profile_of_model
from planner.inplace import ModuleRegion, apply_regions
from planner.passes.step import call, training_loss
from planner.solvers.errors import PlanFileError, PlannerError
from tests.helpers import assert_same_step_copy

# GPT-ref's architecture, small enough for CI, with activations (not parameter gradients)
# dominating the step so that half of the eager peak is reachable.
SMALL = GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=128, vocab_size=128)
LENGTHS = (128, 96, 64)  # the planned sequence length and two smaller ones


def _example(seed: int = 0):
    return gpt_example(SMALL, batch=4, seed=seed)


def _at_length(example, length: int):
    idx, targets = example
    return idx[:, :length].contiguous(), targets[:, :length].contiguous()


@pytest.fixture(scope="module")
def planned():
    """(model, untouched copy, example, plan at half the eager peak)."""
    model, example = _example()
    reference = copy.deepcopy(model)
    eager_bytes = planner.measure(model, example).peak_bytes
    p = planner.plan(model, example, eager_bytes * 0.5 / 1e9, form="inplace")
    return model, reference, example, p, eager_bytes


def _wrapped(p: planner.Plan) -> list[str]:
    """The modules applying ``p`` gives a forward of their own: its regions' (a span's: the
    module whose forward it is of) and those that run their traced forward."""
    return sorted({r.place.path for r in p.regions} | set(p.traced_forwards))


def test_plan_is_module_granular_and_priced_on_eager(planned):
    model, _, example, p, eager_bytes = planned
    assert p.form == "inplace" and p.solver == "dp"
    assert p.regions, "half the eager peak needs checkpointing"
    assert p.baseline_peak_bytes == eager_bytes  # priced on what eager runs: exact here
    names = dict(model.named_modules())
    for r in p.regions:  # a module, or a span of a module's own forward (an MLP's fc..proj)
        path = r.place.path
        assert path in names, r.name
        assert all(n.startswith(path) for n in r.nodes if not n.startswith("step:")), r
    assert p.predicted_peak_bytes <= p.budget_bytes


def test_selective_and_nested_regions_keep_what_was_planned_bitwise(planned):
    """Op-level keeps (by overload and occurrence) inside a block, and a nested region: the
    gradients are bitwise the model's own and the measured peak is the predicted one."""
    from planner.inplace_form import build_inplace_plan
    from planner.passes.eager import eager_graph
    from planner.solvers.costgraph import Region, Schedule
    from planner.solvers.op_classes import out_bytes, worth_keeping

    model, reference, example, _, _ = planned
    eg = eager_graph(model, example, rates=profile_of_model(model))
    span = {path: s for s, path in eg.spans.items()}
    produced = out_bytes(eg.graph)
    (a, b), (c, d), (e, f) = span["blocks.0"], span["blocks.1"], span["blocks.1.attn"]
    keep = frozenset(i for i in range(a, b) if worth_keeping(eg.graph, i, produced))
    schedule = Schedule(
        (Region(a, b, 0, "selective", keep), Region(c, d), Region(e, f, depth=1)), "manual"
    )
    p = build_inplace_plan(model, eg, schedule, 10**9)
    selective = p.module_regions[0]
    assert selective.kind == "selective" and len(selective.keeps) == len(keep)
    kept_ops = {op for op, _ in selective.keeps}
    assert "aten.addmm.default" in kept_ops <= {"aten.addmm.default", "aten.bmm.default"}
    try:
        p.apply(model)
        assert_same_step_copy(reference, model, example)
        measured = planner.measure(model, example).peak_bytes
    finally:
        planner.remove(model)
    assert measured == pytest.approx(p.predicted_peak_bytes, rel=0.01)
    assert measured < p.baseline_peak_bytes


def test_offload_regions_run_their_hooks_with_bitwise_gradients(planned, monkeypatch):
    """An offload region in place (passes/offload.py): on the CPU the host is the device, so
    nothing is copied, but every saved tensor goes through the pack and unpack hooks (the
    parameters and the block's input stay as they are), and the gradients are bitwise the
    model's own, dropout included."""
    from planner.inplace_form import build_inplace_plan
    from planner.passes import offload
    from planner.passes.eager import eager_graph
    from planner.solvers.costgraph import Region, Schedule

    model, reference, example, _, _ = planned
    eg = eager_graph(model, example, rates=profile_of_model(model))
    (a, b) = next(s for s, path in eg.spans.items() if path == "blocks.1")
    p = build_inplace_plan(model, eg, Schedule((Region(a, b, 0, "offload"),), "manual"), 10**9)
    assert [m.kind for m in p.module_regions] == ["offload"]
    packed, unpacked = [], []
    pack, unpack = offload._Call.pack, offload._Call.unpack
    monkeypatch.setattr(offload._Call, "pack", lambda c, t: packed.append(t) or pack(c, t))
    monkeypatch.setattr(offload._Call, "unpack", lambda c, t: unpacked.append(t) or unpack(c, t))
    try:
        p.apply(model)
        assert_same_step_copy(reference, model, example)
    finally:
        planner.remove(model)
    assert packed and len(unpacked) == len(packed)
    block = dict(model.named_modules())["blocks.1"]
    weights = {t.data_ptr() for t in block.parameters()}
    assert weights & {t.data_ptr() for t in packed}  # linears save their weights: left alone
    assert p.simulation.offload_bytes > 0  # the model prices the activations it sends


def test_apply_keeps_the_model_object_class_and_state(planned):
    model, _, _, p, _ = planned
    keys = list(model.state_dict())
    params = list(model.parameters())
    cls = type(model)
    try:
        assert p.apply(model) is model
        assert type(model) is cls and list(model.state_dict()) == keys
        assert all(a is b for a, b in zip(model.parameters(), params))
        wrapped = [n for n, m in model.named_modules() if "forward" in m.__dict__]
        assert sorted(wrapped) == _wrapped(p)
    finally:
        planner.remove(model)


@pytest.mark.parametrize("length", LENGTHS)
def test_bitwise_gradients_and_within_budget_at_any_length_up_to_the_planned(planned, length):
    model, reference, example, p, _ = planned
    x = _at_length(example, length)
    try:
        p.apply(model)
        assert_same_step_copy(reference, model, x)  # float32, CPU, dropout on, same seed
        measured = planner.measure(model, x).peak_bytes
    finally:
        planner.remove(model)
    assert measured <= p.budget_bytes
    if length == LENGTHS[0]:
        assert measured == pytest.approx(p.predicted_peak_bytes, rel=0.01)


def test_eval_and_no_grad_run_plainly(planned, monkeypatch):
    model, reference, example, p, _ = planned
    calls = []
    real = inplace.checkpoint
    monkeypatch.setattr(inplace, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        p.apply(model)
        with torch.no_grad():
            assert torch.equal(call(model.eval(), example), call(reference.eval(), example))
        model.train()
        reference.train()
        with torch.no_grad():
            call(model, example)
        assert calls == [], "no checkpoint under eval() or torch.no_grad()"
        loss = training_loss(call(model, example))
        # One checkpoint per region in forward (a nested region's runs again in its parent's
        # recomputation, in backward).
        assert len(calls) == sum(r.kind != "offload" for r in p.regions)
        loss.backward()
    finally:
        model.train()
        reference.train()
        model.zero_grad(set_to_none=True)
        planner.remove(model)


def test_remove_restores_every_forward(planned):
    model, reference, example, p, _ = planned
    p.apply(model)
    p.apply(model)  # applying again replaces, never stacks
    assert sum("forward" in m.__dict__ for m in model.modules()) == len(_wrapped(p))
    assert planner.remove(model) is model
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert_same_step_copy(reference, model, example)


def test_saved_plan_applies_to_a_fresh_model_with_the_same_gradients(planned, tmp_path):
    model, _, example, p, _ = planned
    path = tmp_path / "plan.json"
    p.save(path)
    fresh, _ = _example()
    try:
        p.apply(model)
        assert planner.apply_plan(fresh, path) is fresh
        assert_same_step_copy(model, fresh, example)
        wrapped = sorted(n for n, m in fresh.named_modules() if "forward" in m.__dict__)
        assert wrapped == _wrapped(p)
    finally:
        planner.remove(model)


def test_plan_files_that_do_not_fit_are_refused(planned, tmp_path):
    model, _, example, p, _ = planned
    path = tmp_path / "plan.json"
    p.save(path)
    fewer_blocks, _ = gpt_example(GPTConfig(n_layer=1, d_model=64, n_head=2, seq_len=128))
    with pytest.raises(PlanFileError, match=r"'blocks\.1"):  # the first module it lacks
        planner.apply_plan(fewer_blocks, path)
    with pytest.raises(PlanFileError, match="GPT, this model is a Sequential"):
        planner.apply_plan(nn.Sequential(nn.Linear(2, 2)), path)
    with pytest.raises(PlanFileError, match="in-place plan"):
        planner.apply_plan(model, path, example)
    graph_path = tmp_path / "graph.json"
    planner.plan(model, example, 1.0, form="graph").save(graph_path)
    with pytest.raises(PlanFileError, match="example input"):
        planner.apply_plan(model, graph_path)


def test_the_two_forms_say_how_to_use_the_other(planned):
    model, _, example, p, _ = planned
    with pytest.raises(PlannerError, match="p.apply"):
        _ = p.module
    graph_plan = planner.plan(model, example, 1.0, form="graph")
    assert graph_plan.form == "graph"
    with pytest.raises(PlannerError, match="form='inplace'"):
        graph_plan.apply(model)
    with pytest.raises(ValueError, match="form"):
        planner.plan(model, example, 1.0, form="eager")


class _Branchy(nn.Module):
    """Data-dependent control flow: ``extra`` adds an op the plan never saw."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.extra:
            h = h * 2
        return torch.relu(h) + torch.tanh(h)


def test_a_call_that_diverges_from_the_plan_recomputes_and_warns_once():
    torch.manual_seed(0)
    model = nn.Sequential(_Branchy(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    from planner.passes.eager import eager_graph

    eg = eager_graph(model, x, rates=profile_of_model(model))
    (start, stop) = next(s for s, path in eg.spans.items() if path == "0")
    keep = next(i for i in range(start, stop) if "addmm" in eg.graph.nodes[i].op)
    region = ModuleRegion(
        "0", "selective", 0, (eg.op_key(keep, start),), tuple(eg.op_sequence(start, stop))
    )
    apply_regions(model, (region,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the planned path: no warning
        assert_same_step_copy(reference, model, x)
    model[0].extra = reference[0].extra = True
    with pytest.warns(UserWarning, match="module '0' ran other operations than planned"):
        assert_same_step_copy(reference, model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module
        assert_same_step_copy(reference, model, x)


def test_batchnorm_modules_are_regions_that_name_their_statistics():
    """BatchNorm updates its running statistics in forward: a region names them, and its
    recomputation runs on copies (test_user_stack.py checks the statistics bitwise)."""
    from benchmarks.models import residual_cnn_example
    from planner.passes.eager import eager_graph

    model, x = residual_cnn_example(batch=2, size=8)
    eg = eager_graph(model, x, rates=profile_of_model(model))
    bn = [path for path, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert bn and set(bn) <= set(eg.spans.values()) and not set(bn) & set(eg.refused)
    stats = ("num_batches_tracked", "running_mean", "running_var")
    assert all(eg.state_buffers[path] == stats for path in bn)


def test_an_empty_plan_wraps_nothing():
    model, example = _example()
    p = planner.plan(model, example, 100.0, form="inplace")  # the eager step fits
    assert p.regions == () and p.apply(model) is model
    assert not any("forward" in m.__dict__ for m in model.modules())
