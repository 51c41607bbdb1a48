"""Kernel workspaces (``cuda_timing.workspace_bytes``, ``costing.with_workspaces``): scratch a CUDA
kernel allocates and frees inside its call, which no fake tensor shows. Measured on CUDA only
(tests/cuda/test_workspace.py); here a timer injects figures into a tiny MLP's pricing, and the
working sets they raise are checked by hand. On the CPU every figure is 0 and nothing moves."""

from __future__ import annotations

import pytest
import torch

from planner.devices import profile_of_model
from planner.passes.capture import capture
from planner.passes.cuda_timing import workspace_bytes
from planner.passes.eager import eager_graph
from planner.passes.estimate import estimate
from planner.passes.op_call import TensorSpec, op_call
from planner.passes.op_timing import time_calls
from planner.solvers.costgraph import Schedule
from planner.solvers.simulate import simulate
from tests.helpers import fake_calibration

pytestmark = pytest.mark.filterwarnings("ignore::planner.LossFallbackWarning")

# Linear(8, 16) -> ReLU -> Linear(16, 4) on a batch of 2, float32: every size below by hand.
ACT = 2 * 16 * 4  # the first linear's output, the ReLU's, and the gradient of either: 128 B


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(2, 8)


def _shapes(call) -> tuple:
    return tuple(x.shape for x in call.leaves if isinstance(x, TensorSpec))


def _timer(picks: dict):
    """A Timer that prices every call at 1 us and gives the calls ``picks`` chooses (op name,
    tensor shapes) -> bytes their workspace."""

    def timer(calls, device):
        workspaces = {
            c.key_text: n
            for c in calls
            for (op, shapes), n in picks.items()
            if str(c.op) == op and _shapes(c) == shapes
        }
        assert len(workspaces) == len(picks), "each pick names one call of the step"
        return fake_calibration({c.key_text: 1e-6 for c in calls}, workspace_bytes=workspaces)

    return timer


ADDMM = ("aten.addmm.default", ((16,), (2, 8), (8, 16)))  # the first linear, forward
RELU_BWD = ("aten.threshold_backward.default", ((2, 16), (2, 16)))  # the ReLU's backward
# the second linear's backward: its input's gradient (mm: grad (2, 4) @ weight (4, 16)), made
# before its weight's (256 B) and bias's (16 B) gradients, which the node keeps
MM_BWD = ("aten.mm.default", ((2, 4), (4, 16)))


def _priced(picks: dict):
    model, x = _mlp()
    eg = eager_graph(model, x, rates=profile_of_model(model), time_ops=True, timer=_timer(picks))
    return {n.name: n for n in eg.graph.nodes}, eg.graph


def test_costing_folds_each_workspace_in_at_its_calls_live_level():
    w_fwd, w_bwd, w_small = 1000, 3000, 200
    plain, plain_graph = _priced({})
    nodes, graph = _priced({ADDMM: w_fwd, RELU_BWD: w_bwd, MM_BWD: w_small})
    assert "kernel workspaces: 2 nodes' working sets" in graph.meta["timing"]
    # the addmm's output (128 B, which it keeps) is live when its workspace is: temp 0 -> W
    assert plain["0:addmm:0"].fwd_temp_bytes == 0
    assert nodes["0:addmm:0"].fwd_temp_bytes == ACT + w_fwd - ACT
    # the ReLU's backward: its input's gradient (128 B, a buffer the first linear's backward
    # frees) is live under threshold_backward's workspace: temp 0 -> W
    assert plain["1:relu:0"].bwd_temp_bytes == 0
    assert nodes["1:relu:0"].bwd_temp_bytes == ACT + w_bwd - ACT
    # the second linear's backward keeps 128 + 256 + 16 = 400 B; its mm's 200 B of workspace
    # stand on 128 B, under that: max(old temp, 128 + 200 - 400) is the old temp
    assert nodes["2:addmm:0"].bwd_temp_bytes == plain["2:addmm:0"].bwd_temp_bytes == 0
    # nothing else moves
    for name, node in nodes.items():
        if name not in ("0:addmm:0", "1:relu:0"):
            assert node == plain[name], name
    assert graph.tensors == plain_graph.tensors


def test_simulate_prices_the_workspace_where_it_stands():
    """A workspace that dwarfs the step sets its peak: the level simulate priced at that node's
    forward, plus the workspace; recomputing the node prices it again."""
    w = 10**6
    _, plain = _priced({})
    _, graph = _priced({ADDMM: w})
    before = simulate(plain, Schedule())
    level = dict(before.timeline)["fwd:0:addmm:0"]
    after = simulate(graph, Schedule())
    assert after.peak_bytes == max(before.peak_bytes, level + w) == level + w
    assert dict(after.timeline)["fwd:0:addmm:0"] == level + w


def test_graph_form_folds_workspaces_too():
    """The captured graph's tracker records the same calls per node: one injected workspace
    on the first linear's matmul raises that node's forward temp by it."""
    model, x = _mlp()
    c = capture(model, x)
    rates = profile_of_model(model)

    def priced(picks):
        g = estimate(c.module, c.args, c.kwargs, time_ops=True, rates=rates, timer=_timer(picks))
        return g.nodes

    plain, nodes = priced({}), priced({ADDMM: 1000})
    changed = [(b.op, b.fwd_temp_bytes - a.fwd_temp_bytes) for a, b in zip(plain, nodes) if a != b]
    assert changed == [("linear", 1000)], changed  # the first linear (its addmm)


def test_on_the_cpu_every_workspace_is_zero_and_nothing_moves():
    """The step's calls timed for real on the CPU (as ``measure_timing`` times them, without
    its overhead fits, which take seconds) measure no workspace: the timed pricing keeps
    every working set of the untimed one."""
    cpu = torch.device("cpu")

    def timer(calls, device):
        times = time_calls(calls, device)
        assert times and all(workspace_bytes(c, device) == 0 for c in calls)
        return fake_calibration(
            {c.key_text: times.get(c.key) for c in calls},
            workspace_bytes={c.key_text: workspace_bytes(c, device) for c in calls},
        )

    model, x = _mlp()
    rates = profile_of_model(model)
    timed = eager_graph(model, x, rates=rates, time_ops=True, timer=timer).graph
    untimed = eager_graph(model, x, rates=rates).graph
    assert "kernel workspaces" not in timed.meta["timing"]
    assert [(n.fwd_temp_bytes, n.bwd_temp_bytes) for n in timed.nodes] == [
        (n.fwd_temp_bytes, n.bwd_temp_bytes) for n in untimed.nodes
    ]
    a = torch.randn(64, 64)
    mm = op_call(torch.ops.aten.mm.default, (a, a), {})
    time_calls([mm], cpu)
    assert workspace_bytes(mm, cpu) == 0
