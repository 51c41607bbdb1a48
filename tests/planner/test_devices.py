"""Device profiles and the predicted step time."""

from __future__ import annotations

import pytest
import torch

import planner
from benchmarks.models import GPT, GPT_REF_SMALL, gpt_ref_small_example
from planner.devices import PROFILES, device_profile, known_profiles
from planner.planning import price
from planner.solvers.costgraph import Schedule
from planner.solvers.simulate import simulate


def meta_gpt():
    with torch.device("meta"):
        model = GPT(GPT_REF_SMALL)
        idx = torch.zeros(2, GPT_REF_SMALL.seq_len, dtype=torch.long)
    return model, (idx, idx)


def test_named_profiles_price_a_meta_model_by_their_rates():
    model, example = meta_gpt()
    h100 = price(model, example, device="h100").graph
    a100 = price(model, example, device="a100-40gb").graph
    assert h100.meta["device"] == "h100" and h100.meta["timing"] == "roofline"
    assert (h100.flops_per_s, h100.bytes_per_s) == (
        PROFILES["h100"].flops_per_s,
        PROFILES["h100"].bytes_per_s,
    )
    assert a100.offload_bytes_per_s == PROFILES["a100-40gb"].host_bytes_per_s
    # The same step, priced by each roofline node by node: the H100 is faster on every node.
    expected = sum(
        max(n.fwd_flops / h100.flops_per_s, n.fwd_bytes_accessed / h100.bytes_per_s)
        + max(n.bwd_flops / h100.flops_per_s, n.bwd_bytes_accessed / h100.bytes_per_s)
        for n in h100.nodes
    )
    assert h100.step_time_s == pytest.approx(expected)
    assert 0 < h100.step_time_s < a100.step_time_s


def test_own_profile_and_bad_names():
    mine = planner.DeviceProfile("mine", 1e12, 1e11, 1e10)
    assert device_profile(mine) is mine
    assert device_profile("H100") is PROFILES["h100"]
    cpu = device_profile("cpu")
    assert cpu.flops_per_s > 1e8 and cpu.bytes_per_s > 1e8
    with pytest.raises(ValueError) as info:
        planner.plan(*gpt_ref_small_example(), mem_budget_gb=1, device="b200", form="graph")
    for name in known_profiles():
        assert name in str(info.value)
    with pytest.raises(ValueError, match="flops_per_s must be a positive finite rate"):
        planner.DeviceProfile("bad", 0, 1e9, 1e9)


def test_predicted_step_time_is_forward_backward_plus_recompute():
    model, example = gpt_ref_small_example()
    priced = price(model, example, device="cpu")
    eager = priced.plan(10**9, "none")
    assert eager.predicted_step_time_s == pytest.approx(priced.graph.step_time_s)
    every = priced.plan(10**9, "uniform")
    assert every.predicted_recompute_time_s > 0
    assert every.predicted_step_time_s == pytest.approx(
        priced.graph.step_time_s + every.predicted_recompute_time_s
    )
    assert simulate(priced.graph, Schedule()).step_time_s == pytest.approx(
        eager.predicted_step_time_s
    )
    text = every.summary()
    assert f"predicted step time {every.predicted_step_time_s * 1e3:,.2f} ms" in text


def test_inplace_form_prices_time_with_the_device_asked_for():
    model, example = gpt_ref_small_example()
    plans = {
        name: planner.plan(
            model, example, mem_budget_gb=1, solver="none", form="inplace", device=name
        )
        for name in ("h100", "cpu")
    }
    for name, p in plans.items():
        rates = device_profile(name)
        g = p.graph
        assert (g.flops_per_s, g.bytes_per_s) == (rates.flops_per_s, rates.bytes_per_s)
        # No regions: the step is forward + backward, each node at its roofline with these rates.
        roofline = sum(
            max(n.fwd_flops / rates.flops_per_s, n.fwd_bytes_accessed / rates.bytes_per_s)
            + max(n.bwd_flops / rates.flops_per_s, n.bwd_bytes_accessed / rates.bytes_per_s)
            for n in g.nodes
        )
        assert p.predicted_step_time_s == pytest.approx(roofline)
    assert 0 < plans["h100"].predicted_step_time_s < plans["cpu"].predicted_step_time_s / 10
