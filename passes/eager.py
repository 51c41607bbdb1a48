"""Eager: price what the model's own forward runs, op by op, on fake tensors.

In: an ``nn.Module`` (not a captured graph), its example args/kwargs and optionally the loss
function. Out: an :class:`EagerGraph`: a :class:`planner.solvers.costgraph.CostGraph` whose nodes
are the aten operations of one forward + loss step in dispatch order, named
``<module path>:<op>:<k>`` (``blocks.0.attn:addmm:2``; ``model:...`` for the root's own ops,
``step:...`` for the loss outside the model), with ``op`` the overload (``aten.addmm.default``)
-- exactly what ``torch.utils.checkpoint``'s selective-checkpoint dispatch mode sees at run time,
since this is the model's own code, not an export of it -- and ``region_spans``: the node
interval of each submodule call that may become a region applied in place.

How: the step runs ONCE under ``FakeTensorMode`` with the tracker of ``passes/trace.py``, which
here opens one record per aten op (``passes/eager_tracker.py``); ``passes/costing.py`` turns the
records into the CostGraph, as for ``estimate``. An op's grad_fn is attached after it returns
from dispatch, so the previous ops' outputs (held by weakref only) are claimed as the next op
starts (``Tracker.claim``), and a save, which autograd makes before the op reaches dispatch, is
attributed to the node whose backward unpacks it (``Tracker.saving``). The model's forward
then runs once more, under ``torch.no_grad()``, only to learn when Python drops the storages
autograd saved (``passes/python_lifetimes.py``).

Module calls: every submodule's ``forward`` is wrapped during the run (an instance attribute,
removed afterwards), so a span is exactly the ops a wrapped ``forward`` runs -- what
``planner/inplace.py`` will checkpoint. Not candidates (``EagerGraph.refused`` says why): modules
called more than once per step (a region is every call of a module, and the plans here price
one), calls under ``torch.no_grad``, spans that write state other than the module's own buffers,
and spans an in-place write crosses. Spans that write their own buffers (BatchNorm running
statistics) are candidates: ``EagerGraph.state_buffers`` names the buffers, which an applied
region's recomputation runs on copies of, so they are updated once per step. Runs of two or
more consecutive children of an ``nn.Sequential`` (``RunPlace``, ``path[a:b]``) are candidates too
(``passes/candidates.py``): one region per child holds every child's input at the last one's
backward, a run nested over them frees those inputs (ResidualCNN, 4 blocks: least 51.6% of
eager with one region per block, 43.2% with runs). So are spans of a module's own forward, its
own ops and child calls together, where torch.fx traces it with its children as leaves and the
trace runs the module's ops (``passes/parent_candidates.py``, ``passes/parent_spans.py``): the
U-Net's root, whose ``cat``s and max-pools are no module's (least 81.6% of eager without them,
51.5% with them).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from planner.passes.attention_kernels import TargetAttention, prices_other_kernels
from planner.passes.candidates import EagerGraph, module_candidates
from planner.passes.costing import cost_graph, with_measured_times
from planner.passes.eager_tracker import OpTracker, read_by_calls, recording_calls
from planner.passes.mask_decisions import mask_decisions_as_eager
from planner.passes.op_timing import Timer
from planner.passes.parent_candidates import span_cuts, traceable_parents, with_parent_spans
from planner.passes.python_lifetimes import python_lifetimes
from planner.passes.step import (
    LossFn,
    StepTime,
    amp_forward,
    data_dependent_error,
    data_dependent_errors,
    loss_on_fake_tensors,
    model_input,
    precision_text,
    split_input,
    training_loss,
)
from planner.passes.trace import fake_step, is_tensor, step_device
from planner.solvers.rates import DeviceProfile


def eager_graph(
    model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
    *,
    rates: DeviceProfile,
    time_ops: bool = False,
    step_time: StepTime | None = None,
    timer: Timer | None = None,
    parent_spans: bool = True,
    time_limit_s: float | None = None,
) -> EagerGraph:
    """Price one forward+loss+backward step of ``model`` as eager runs it (module docstring).

    ``time_limit_s``: the priced run's forward and backward stop with a ``PlannerError`` naming
    the module they were in when they run longer (a model whose tracing never ends must not
    hang the caller); None: no limit.
    ``parent_spans``: offer spans of modules' own forwards as candidates
    (``passes/parent_spans.py``; off for FSDP2 plans, whose units' hooks they are not yet
    measured with).

    ``rates``: the device to price time for (the planner passes the model's own device's,
    ``planner.devices.profile_of_model``);
    ``time_ops``, ``step_time`` and ``timer`` as for ``passes.estimate.estimate``: time the
    step's aten calls on the model's real device (from ``timer``, a device's calibration),
    fitted to its measured step if given.
    """
    other_kernels = prices_other_kernels(rates, step_device(model, example_input))
    attention = TargetAttention(rates) if other_kernels else None
    tracker = OpTracker(record_calls=time_ops, attention=attention)
    if time_limit_s is not None:
        tracker.deadline = time.monotonic() + time_limit_s
    fs = fake_step(model, example_input, tracker)
    call_args, call_kwargs = model_input(model, fs.batch, loss_fn)
    _, kwargs = split_input(example_input)
    with (
        mask_decisions_as_eager(kwargs),
        recording_calls(model, tracker) as calls,
        fs.running(),
    ):
        tracker.recording = True
        with tracker.saving():
            try:
                with amp_forward():
                    out = model(*call_args, **call_kwargs)
                    with loss_on_fake_tensors():
                        loss = training_loss(out, loss_fn, fs.batch, warn=True)
                    tracker.release_casts(len(tracker.records) - 1)
            except data_dependent_errors() as e:
                where = tracker.failed_in
                kind = None if where is None else type(model.get_submodule(where)).__name__
                raise data_dependent_error(where, kind, e) from e
        tracker.claim_pending()
        tracker.recording = False
        if not tracker.records:
            raise ValueError(f"{type(model).__name__}'s forward ran no tensor operation")
        tracker.mark_outputs(out)
        del out
        tracker.backward(loss, len(tracker.records) - 1)
        del loss
    buffer_of = {
        id(rec): name
        for name in dict(model.named_buffers(remove_duplicate=False))
        if (rec := tracker.lookup(fs.state[name])) is not None
    }
    # node -> the model state it writes, by buffer name (None: state that is no buffer)
    written = {i: {buffer_of.get(r) for r in recs} for i, recs in tracker.state_written.items()}
    read_by_calls(tracker)
    parents, not_parents = traceable_parents(model, calls, tracker) if parent_spans else ({}, {})
    offered, held_otherwise = span_cuts(model, example_input, tracker, parents, not_parents)
    traced = {path: parents[path].gm for path in held_otherwise}
    lifetimes = python_lifetimes(model, example_input, loss_fn, tracker, traced)

    graph = cost_graph(tracker, example_input, rates, fs.device, "fake tensors, eager")
    meta = {**graph.meta, "precision": precision_text(model), "python_lifetimes": lifetimes}
    meta.update(_target_notes(tracker, rates, kwargs))
    meta.update(_untied_note(model))
    graph = replace(graph, meta=meta)
    if time_ops:
        graph = with_measured_times(graph, tracker, fs.device, rates, step_time, timer)
    eg = module_candidates(model, graph, calls, written, tracker.aliased_args)
    eg = with_parent_spans(model, eg, parents, offered, written, not_parents)
    return replace(eg, traced_forwards=tuple(traced))


def _target_notes(tracker: OpTracker, rates: DeviceProfile, kwargs: dict) -> dict[str, str]:
    """What the summary says of pricing for another device than the model's: the attention
    kernels priced as it runs them, the input values meta tensors could not show, and what
    a profile cannot price."""
    notes = {}
    if tracker.attention is not None and tracker.attention.chosen:
        notes["attention"] = f"as {rates.name} runs it: {tracker.attention.summary()}"
    unknown = [k for k, v in kwargs.items() if "mask" in k and is_tensor(v) and v.is_meta]
    if unknown:
        notes["unknown_values"] = (
            f"{', '.join(unknown)} on the meta device (values unknown): priced as padded, the "
            f"masked attention path"
        )
    if tracker.cuda_blocks:
        notes["unpriced"] = (
            "kernel workspaces (cuBLAS, attention) are not priced on a profile: plan on the GPU "
            "to measure them (the allocator's 512-byte blocks are priced)"
        )
    return notes


def _untied_note(model: torch.nn.Module) -> dict[str, str]:
    """A Hugging Face model whose config ties its output embedding to its input embedding but
    whose two weights are separate tensors: ``Module.to("meta")`` does that (each module gets
    its own copy of a shared parameter), and the plan then prices a second weight gradient."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    try:
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        return {}
    if tied:
        return {}
    return {
        "untied": "the config ties the output embedding to the input embedding, but the model "
        "holds two weights (Module.to('meta') unties them): priced with two; build the model "
        "under `with torch.device('meta')` or call model.tie_weights() first"
    }
