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
here opens one record per aten op; ``passes/costing.py`` turns the records into the CostGraph,
as for ``estimate``. An op's grad_fn is attached after it returns from dispatch, so the previous
ops' outputs (held by weakref only) are claimed as the next op starts (``Tracker.claim``), and a
save, which autograd makes before the op reaches dispatch, is attributed to the node whose
backward unpacks it (``Tracker.saving``). The model's forward then runs once more, under
``torch.no_grad()``, only to learn when Python drops the storages autograd saved
(``_python_lifetimes``).

Module calls: every submodule's ``forward`` is wrapped during the run (an instance attribute,
removed afterwards), so a span is exactly the ops a wrapped ``forward`` runs -- what
``planner/inplace.py`` will checkpoint. Not candidates (``EagerGraph.refused`` says why): modules
called more than once per step (a region is every call of a module, and the plans here price
one), calls under ``torch.no_grad``, spans that write state other than the module's own buffers,
and spans an in-place write crosses. Spans that write their own buffers (BatchNorm running
statistics) are candidates: ``EagerGraph.state_buffers`` names the buffers, which an applied
region's recomputation runs on copies of, so they are updated once per step. Runs of two or
more consecutive children of an ``nn.Sequential`` (named ``path[a:b]``) are candidates too
(:func:`_sequential_runs`): one region per child holds every child's input at the last one's
backward, a run nested over them frees those inputs (ResidualCNN, 4 blocks: least 51.6% of
eager with one region per block, 43.2% with runs). So are spans of a module's own forward, its
own ops and child calls together, where torch.fx traces it with its children as leaves and the
trace runs the module's ops (:func:`_traceable_parents`, :func:`_parent_node_ops`,
``passes/parent_spans.py``): the U-Net's root, whose ``cat``s and max-pools are no module's
(least 81.6% of eager without them, 51.5% with them).
"""

from __future__ import annotations

import difflib
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.weak import WeakIdKeyDictionary

from planner.passes.attention_kernels import TargetAttention, prices_other_kernels
from planner.passes.costing import cost_graph, with_measured_times
from planner.passes.forward_wrapper import ForwardWrapper
from planner.passes.op_timing import Timer
from planner.passes.parent_spans import (
    MAX_SPAN_CUTS,
    NodeOps,
    forward_arity,
    in_order,
    spans_of,
    trace_parent,
    writes_in_place,
)
from planner.passes.regions import ModulePlace, Place, RunPlace, SpanPlace
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
from planner.passes.trace import OpRecord, Tracker, fake_step, is_tensor, step_device
from planner.solvers.costgraph import CostGraph
from planner.solvers.cuts import forbidden_cuts
from planner.solvers.errors import PricingTimeLimitError
from planner.solvers.rates import DeviceProfile

# Ops selective checkpointing lets through without asking its policy (nor counting them).
UNCOUNTED_OPS = frozenset(str(op) for op in SAC_IGNORED_OPS)


@dataclass(frozen=True)
class EagerGraph:
    """A priced eager step and the module calls that may become regions.

    ``places``: (start, stop) -> where in the model the region over that span would run
    (``passes/regions.py``: a module, a run of a Sequential's children, a span of a module's own
    forward), for every span in ``graph.region_spans`` (the outermost module when several share
    one span); ``spans``: the same spans -> their places' names. ``refused``: module path (or
    run, or traced forward) name -> why it is not a candidate. ``module_types``: module path
    -> class name, of every module of the model.
    ``module_spans``: module path -> (start, stop), of every module called exactly once per
    step (candidate or not), for passes that place events at module boundaries (FSDP2 units).
    """

    graph: CostGraph
    places: dict[tuple[int, int], Place]
    refused: dict[str, str]
    module_types: dict[str, str]
    module_spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    # candidate path -> the buffers its forward writes (BatchNorm statistics), relative to it:
    # an applied region runs its recomputations on copies of them (``planner/inplace.py``)
    state_buffers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the modules with spans whose traced forward drops some storage earlier than their own
    # forward does, priced as the traced forward runs (their storages' lifetimes:
    # :func:`_python_lifetimes`): a plan runs that forward for each one inside a region
    # (``traced_forwards_needed``)
    traced_forwards: tuple[str, ...] = ()

    @property
    def spans(self) -> dict[tuple[int, int], str]:
        """(start, stop) -> the name of the region over that span (its place's)."""
        return {span: place.name for span, place in self.places.items()}

    def traced_forwards_needed(self, regions: Iterable[tuple[int, int]]) -> tuple[str, ...]:
        """The modules a plan of ``regions`` ([start, stop) node intervals, each in ``places``)
        runs as their fx trace does (``passes/parent_spans.py``): those holding a span of their
        own, and those of ``traced_forwards`` whose call lies inside a region (their storages'
        lifetimes are then Python's, priced as the traced forward drops them)."""
        regions = tuple(regions)
        owners = {p.path for r in regions if isinstance(p := self.places[r], SpanPlace)}
        return tuple(sorted(owners)) + tuple(
            path
            for path in self.traced_forwards
            if path not in owners
            and any(
                a <= self.module_spans[path][0] <= self.module_spans[path][1] <= b
                for a, b in regions
            )
        )

    def op_sequence(self, start: int, stop: int) -> list[str]:
        """The overloads a selective-checkpoint policy sees in nodes [start, stop), in order."""
        ops = (self.graph.nodes[i].op for i in range(start, stop))
        return [op for op in ops if op not in UNCOUNTED_OPS]

    def op_key(self, i: int, start: int) -> tuple[str, int]:
        """(overload, occurrence of it since ``start``): how a policy names node ``i``."""
        op = self.graph.nodes[i].op
        return op, self.op_sequence(start, i).count(op)


class _OpTracker(Tracker):
    """The tracker, opening one record per aten op of the forward and loss."""

    def __init__(
        self, record_calls: bool = False, attention: TargetAttention | None = None
    ) -> None:
        super().__init__(record_calls)
        self.recording = False
        # the target device's attention kernels, where the plan is for another device than the
        # model's (``passes/attention_kernels.py``); every run of the model prices them alike
        self.attention = attention
        self.cuda_blocks = attention is not None and attention.target.kernels == "cuda"
        self.deadline = math.inf  # time.monotonic() past which tracing stops (eager_graph)
        self.path_stack: list[str] = []
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        # (node, its outputs as (weak reference, version when made)) whose grad_fns are unclaimed
        self.pending: list[tuple[int, list[tuple[weakref.ref, int]]]] = []
        self.failed_in: str | None = None  # the innermost module a failing forward ran
        # (start, stop, storage records) of each module call: the tensors it was passed
        self.call_args: list[tuple[int, int, list[Any]]] = []
        self.aliased_args: set[str] = set()  # modules called with one tensor in two arguments
        # module path -> per call, its arguments when they are all tensors (else None): how many
        # positional, the keywords, each tensor's (shape, stride, dtype, device). A parent's
        # spans run its traced forward, offered only for such calls (:func:`_parent_node_ops`)
        self.tensor_args: dict[str, list[Any]] = defaultdict(list)

    def _free(self, key: int, rec: Any) -> None:
        if self.recording and self.phase == "fwd":
            self.died_at[id(rec)] = self.node  # Python, not the last reader, freed it
        super()._free(key, rec)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.internal or not self.recording or self.phase != "fwd":
            return super().__torch_dispatch__(func, types, args, kwargs)
        if func in SAC_IGNORED_OPS:  # metadata queries and detach: no op of the model's
            return func(*args, **(kwargs or {}))
        if time.monotonic() > self.deadline:
            raise PricingTimeLimitError(self.path_stack[-1] if self.path_stack else None)
        self.claim_pending()
        i = len(self.records)
        path = self.path_stack[-1] if self.path_stack else None
        # outside the model: the loss, its ops nodes of their own (``step:...``), which no
        # region holds (regions are module calls); the graph form, whose every node may be in
        # a region, charges them to its last node instead (``estimate._charged_to``)
        prefix = ("model" if path == "" else path) if path is not None else "step"
        short = func._overloadpacket.__name__
        name = f"{prefix}:{short}:{self.counts[(prefix, short)]}"
        self.counts[(prefix, short)] += 1
        record = OpRecord(name=name, op=str(func), module_path=path or "", inputs=set())
        self.records.append(record)
        read, producers, seg = self.enter_node(i, (args, kwargs))
        record.inputs = producers - {i}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        outs = self.exit_node(record, read, seg, out)
        # autograd attaches the grad_fn after dispatch returns: claimed as the next op starts
        self.pending.append((i, [(weakref.ref(t), t._version) for t in outs]))
        return out

    def claim_pending(self) -> None:
        """Map the grad_fns autograd attached to earlier ops' outputs to those ops.

        A view written in place since it was made is left to the op that wrote it: autograd
        may be rebasing its history right now, and its ``grad_fn`` read then replays the view
        under the lock autograd holds (DeepSeek-V3's ``key_states[..., :n].copy_(...)``
        deadlocked here). Ops dispatched while claiming are the tracker's own, not the model's."""
        pending, self.pending = self.pending, []
        self.internal += 1
        try:
            for i, refs in pending:
                alive = [(t, made) for ref, made in refs if (t := ref()) is not None]
                self.claim([t for t, made in alive if not _rebased_view(t, made)], i)
        finally:
            self.internal -= 1


def _rebased_view(t: torch.Tensor, version_made: int) -> bool:
    """Whether ``t`` is a view written in place since its op returned (its history rebased)."""
    return t._is_view() and t._version != version_made


class _CallRecorder(ForwardWrapper):
    def __init__(self, path: str, tracker: _OpTracker, calls: dict) -> None:
        self.path, self.tracker, self.calls = path, tracker, calls

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        tracker = self.tracker
        start, grad = len(tracker.records), torch.is_grad_enabled()
        passed = [
            rec
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and (rec := tracker.lookup(t)) is not None
        ]
        ids = [id(t) for t in tree_leaves((args, kwargs)) if is_tensor(t)]
        if len(ids) != len(set(ids)):
            tracker.aliased_args.add(self.path)
        values = (*args, *kwargs.values())
        tracker.tensor_args[self.path].append(
            (len(args), tuple(kwargs), [_tensor_meta(t) for t in values])
            if all(isinstance(t, torch.Tensor) for t in values)
            else None
        )
        tracker.path_stack.append(self.path)
        try:
            return self.run_original(module, *args, **kwargs)
        except Exception:
            if tracker.failed_in is None:  # the innermost module running when it failed
                tracker.failed_in = self.path
            raise
        finally:
            tracker.path_stack.pop()
            self.calls[self.path].append((start, len(tracker.records), grad))
            tracker.call_args.append((start, len(tracker.records), passed))


@contextmanager
def _recording_calls(model: torch.nn.Module, tracker: _OpTracker) -> Iterator[dict]:
    calls: dict[str, list[tuple[int, int, bool]]] = defaultdict(list)
    installed: list[tuple[_CallRecorder, torch.nn.Module]] = []
    try:
        for path, module in model.named_modules():
            recorder = _CallRecorder(path, tracker, calls)
            recorder.install(module)
            installed.append((recorder, module))
        with tracker.attention or nullcontext():  # the target's attention kernels, if another
            yield calls
    finally:
        for recorder, module in reversed(installed):
            recorder.uninstall(module)


class _AllOnes(TorchFunctionMode):
    """Remembers the tensors made while it is active that hold only ones, values a fake tensor
    cannot show: ``torch.ones`` and the like, and casts, views and selections of them."""

    MAKE = (torch.ones, torch.ones_like, torch.Tensor.new_ones)
    KEEP = (torch.Tensor.to, torch.Tensor.bool, torch.Tensor.__getitem__, torch.Tensor.view,
            torch.Tensor.reshape, torch.Tensor.expand)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weak: pricing sees every free

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = func in self.MAKE or (func in self.KEEP and args[0] in self.made)
        if made and isinstance(out, torch.Tensor):
            self.made[out] = True
        return out


@contextmanager
def _mask_decisions_as_eager(kwargs: dict[str, Any]) -> Iterator[None]:
    """Let transformers take the attention path eager takes, which it decides from values.

    Before building an attention mask, transformers asks whether the position ids pack several
    sequences in a row (``find_packed_sequence_indices``) and whether a padding mask is all
    ones (``_ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa``); only if neither
    needs a mask does SDPA run without one (``is_causal``, the flash kernel). On fake tensors it
    cannot read values, so it always builds the (batch, 1, S, S) mask and SDPA takes the masked
    path: the priced step held up to 16% more than eager's on decoders called without a mask.
    Here the answers come from the real example input instead, where they are certain:

    - packed sequences: from the caller's real ``position_ids``; without them transformers
      numbers each row 0..S-1 itself, which never packs;
    - a padding mask the caller passed (keys naming a ``mask``): every one all ones means no
      token is masked, as eager sees it.

    - a padding mask the model makes itself: all ones when it is ``torch.ones`` or a cast, view
      or selection of it (Bart's decoder makes one when called without a decoder mask, and eager
      then takes the unmasked path; priced masked, a selective region's op keys no longer
      matched eager's ops and plans were over-predicted by up to 17%). Any other mask the model
      makes is left to transformers' fake-tensor answer: a mask, on the safe side.

    Nothing changes if transformers was not imported or lacks these functions.
    """
    import sys

    mu = sys.modules.get("transformers.masking_utils")
    names = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa")
    if mu is None or not all(hasattr(mu, n) for n in names):
        yield
        return
    positions = kwargs.get("position_ids")
    packed = (
        is_tensor(positions)
        and not positions.is_meta  # values unknown: rows numbered 0..S-1, as transformers does
        and mu.find_packed_sequence_indices(positions) is not None
    )
    masks = [v for k, v in kwargs.items() if "mask" in k and is_tensor(v)]
    # a mask on the meta device has no values: priced padded, the masked path (summary says)
    unmasked = bool(masks) and all(not m.is_meta and bool(m.all()) for m in masks)
    optional = ("_ignore_bidirectional_mask_sdpa",)
    originals = {n: getattr(mu, n) for n in (*names, *optional) if hasattr(mu, n)}

    def find_packed(position_ids: Any) -> Any:
        if isinstance(position_ids, FakeTensor) and not packed:
            return None
        return originals["find_packed_sequence_indices"](position_ids)

    ones = _AllOnes()

    def ignore_mask(name: str) -> Callable[..., bool]:
        def ignore(padding_mask: Any, *args: Any, **kw: Any) -> bool:
            if isinstance(padding_mask, FakeTensor) and (unmasked or padding_mask in ones.made):
                padding_mask = None
            return originals[name](padding_mask, *args, **kw)

        return ignore

    patched = {
        "find_packed_sequence_indices": find_packed,
        **{n: ignore_mask(n) for n in originals if n != "find_packed_sequence_indices"},
    }
    try:
        for n, f in patched.items():
            setattr(mu, n, f)
        with ones:
            yield
    finally:
        for n, f in originals.items():
            setattr(mu, n, f)


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
    tracker = _OpTracker(record_calls=time_ops, attention=attention)
    if time_limit_s is not None:
        tracker.deadline = time.monotonic() + time_limit_s
    fs = fake_step(model, example_input, tracker)
    call_args, call_kwargs = model_input(model, fs.batch, loss_fn)
    _, kwargs = split_input(example_input)
    with (
        _mask_decisions_as_eager(kwargs),
        _recording_calls(model, tracker) as calls,
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
    _read_by_calls(tracker)
    parents, not_parents = _traceable_parents(model, calls, tracker) if parent_spans else ({}, {})
    offered, held_otherwise = _span_cuts(model, example_input, tracker, parents, not_parents)
    traced = {path: parents[path].gm for path in held_otherwise}
    lifetimes = _python_lifetimes(model, example_input, loss_fn, tracker, traced)

    graph = cost_graph(tracker, example_input, rates, fs.device, "fake tensors, eager")
    meta = {**graph.meta, "precision": precision_text(model), "python_lifetimes": lifetimes}
    meta.update(_target_notes(tracker, rates, kwargs))
    meta.update(_untied_note(model))
    graph = replace(graph, meta=meta)
    if time_ops:
        graph = with_measured_times(graph, tracker, fs.device, rates, step_time, timer)
    eg = _candidates(model, graph, calls, written, tracker.aliased_args)
    eg = _with_parent_spans(model, eg, parents, offered, written, not_parents)
    return replace(eg, traced_forwards=tuple(traced))


def _target_notes(tracker: _OpTracker, rates: DeviceProfile, kwargs: dict) -> dict[str, str]:
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


def _python_lifetimes(
    model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None,
    tracker: _OpTracker,
    traced: dict[str, fx.GraphModule],
) -> str:
    """Learn when Python drops the storages autograd saved, and note it in ``tracker.died_at``.

    A storage saved for backward outlives the forward in the priced run, so its finalizer never
    says when Python let go of it; but inside a region, which saves nothing, Python's own
    references are what keep it (``Tensor.freed_after``, simulate's Rule 1). Bloom's attention
    returns its (B, H, S, S) attention probabilities beside its output, and the model's block
    loop holds them in ``outputs`` until the next block returns: priced dead at the region's end,
    a checkpointed Bloom measured 838,144 B above its prediction. So the model's forward runs a
    second time on fake tensors under ``torch.no_grad()``, where nothing is saved and every
    storage dies when Python drops it; its ops are matched to the priced run's by name
    (``<module path>:<op>:<k>``), op and output shapes, and each saved storage takes the death
    of its counterpart (an op of that run that the priced run lacks maps to the priced run's
    node before the next match: later, on the safe side). Returns how it went, for the graph's
    ``meta``.

    The modules in ``traced`` (path -> traced forward: ``passes/parent_spans.py``) run their
    traced forward in that run, as an applied plan runs them where their storages' lifetimes
    count: inside a region (``EagerGraph.traced_forwards``). fx's code drops each value at its
    last use; the module's own code may hold it longer (the U-Net's list of skips: 232,640 B
    least, measured 221,420 B, priced on the original forward; 213,300 B, exact, on the traced).
    """
    saved = [
        (i, j, rec)
        for (phase, i), recs in tracker.allocated.items()
        if phase == "fwd" and i >= 0
        for j, rec in enumerate(recs)
        if rec.saved_by and id(rec) not in tracker.died_at and id(rec) not in tracker.casts
    ]
    if not saved:
        return "no saved storage"
    other = _OpTracker(attention=tracker.attention)
    fs = fake_step(model, example_input, other)
    call_args, call_kwargs = model_input(model, fs.batch, loss_fn)
    _, kwargs = split_input(example_input)
    try:
        with (
            _mask_decisions_as_eager(kwargs),
            _running_traced(model, traced),
            _recording_calls(model, other),
            fs.running(),
            torch.no_grad(),
        ):
            other.recording = True
            with amp_forward():
                out = model(*call_args, **call_kwargs)
            other.claim_pending()
            other.recording = False
            del out
    except Exception as e:  # noqa: BLE001 - the priced run stands; only these lifetimes are lost
        return f"unknown for saved storages (the forward under no_grad failed: {e!r:.200})"
    key = [(r.name, r.op, tuple(r.shapes)) for r in tracker.records]
    key_other = [(r.name, r.op, tuple(r.shapes)) for r in other.records]
    to_priced: dict[int, int] = {}  # node of the no_grad run -> the priced run's node
    if key == key_other:
        to_priced = {k: k for k in range(len(key))}
    else:
        matcher = difflib.SequenceMatcher(None, key, key_other, autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            to_priced.update({b + d: a + d for d in range(size)})
    from_priced = {a: b for b, a in to_priced.items()}
    # an unmatched node of the no_grad run: the priced node before the next matched one
    later = [len(tracker.records) - 1] * (len(other.records) + 1)
    for b in range(len(other.records) - 1, -1, -1):
        later[b] = to_priced[b] if b in to_priced else later[b + 1] - (b + 1 in to_priced)
    held = 0
    for i, j, rec in saved:
        b = from_priced.get(i)
        if b is None:
            continue
        recs = other.allocated.get(("fwd", b), [])
        if len(recs) <= j or recs[j].nbytes != rec.nbytes:
            continue
        died = other.died_at.get(id(recs[j]))
        if died is not None and died >= 0:
            tracker.died_at[id(rec)] = later[died]
            held += 1
    return f"from a forward under no_grad: {held} of {len(saved)} saved storages"


@dataclass(frozen=True)
class _Parent:
    """A module whose own forward may hold spans: its traced forward, its call's op interval
    and arguments (``_OpTracker.tensor_args``)."""

    gm: fx.GraphModule
    span: tuple[int, int]
    call: tuple[int, tuple[str, ...], list[tuple[Any, ...]]]


def _tensor_meta(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _traceable_parents(
    model: torch.nn.Module, calls: dict[str, list[tuple[int, int, bool]]], tracker: _OpTracker
) -> tuple[dict[str, _Parent], dict[str, str]]:
    """(path -> :class:`_Parent`, ``path(..)`` -> why not) of the modules with children and ops
    of their own whose forward may hold spans (``passes/parent_spans.py``): called once per
    step, with grad, passing a tensor to each parameter of its forward (the traced forward
    runs only such calls), traced by fx with its children as leaves, writing no tensor in
    place (a recomputation would read the written value). nn.Sequential's own forward runs
    nothing of its own (its runs are :func:`_sequential_runs`)."""
    parents: dict[str, _Parent] = {}
    why: dict[str, str] = {}
    for path, module in model.named_modules():
        made = calls.get(path, [])
        if len(made) != 1 or next(module.children(), None) is None:
            continue
        start, stop, grad = made[0]
        if not grad or not any(tracker.records[i].module_path == path for i in range(start, stop)):
            continue
        try:
            arity, (call,) = forward_arity(module), tracker.tensor_args[path]
            if call is None or len(call[2]) != arity:
                raise ValueError("it is not called with one tensor for each forward parameter")
            gm = trace_parent(module)
            if (node := writes_in_place(gm)) is not None:
                raise ValueError(f"its node {node} writes a tensor in place")
        except Exception as e:  # noqa: BLE001 - fx's errors are many; a parent offers no spans
            why[SpanPlace(path, "", "").name] = f"no spans of its own forward: {e}"[:300]
            continue
        parents[path] = _Parent(gm, (start, stop), call)
    return parents, why


def _parent_node_ops(
    model: torch.nn.Module,
    example_input: Any,
    tracker: _OpTracker,
    parents: dict[str, _Parent],
    why: dict[str, str],
) -> tuple[dict[str, dict[str, tuple[int, int]]], set[str]]:
    """(parent path -> fx node name -> [start, stop): the priced step's ops each call node of
    the parent's traced forward runs; the parents whose traced forward drops some storage at
    another op than their own forward does).

    Each parent is called alone, under no_grad on fake tensors shaped as its priced call's
    arguments, twice: its own forward, then its traced forward (``parent_spans.NodeOps``).
    Only parents whose two runs dispatch the priced call's ops (names, overloads, output
    shapes) offer spans; the others are noted in ``why``. fx's code drops each value at its
    last use, a module's own code may hold it longer (the U-Net's list of skips)."""
    if not parents:
        return {}, set()
    other = _OpTracker(attention=tracker.attention)
    fs = fake_step(model, example_input, other)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    held_otherwise: set[str] = set()

    def key(start: int) -> list[tuple[Any, ...]]:
        return [(r.name, r.op, tuple(r.shapes)) for r in other.records[start:]]

    def deaths(start: int) -> list[int | None]:
        """When Python dropped each storage the run allocated, by op, from its start."""
        return [
            None if (d := other.died_at.get(id(rec))) is None else d - start
            for i in range(start, len(other.records))
            for rec in other.allocated.get(("fwd", i), [])
        ]

    with _recording_calls(model, other), fs.running(), torch.no_grad():
        for path, parent in parents.items():
            module = model.get_submodule(path)
            n_args, names, metas = parent.call
            values = [torch.empty_strided(*m[:2], dtype=m[2], device=m[3]) for m in metas]
            args, kwargs = values[:n_args], dict(zip(names, values[n_args:], strict=True))
            runs = []
            try:
                for traced in (False, True):
                    other.counts.clear()
                    start, other.recording = len(other.records), True
                    with amp_forward():
                        if traced:  # its ops named as the module's, as a call of it names them
                            run = NodeOps(module, parent.gm, lambda: len(other.records))
                            other.path_stack.append(path)
                            try:
                                run.run(*in_order(module, args, kwargs))
                            finally:
                                other.path_stack.pop()
                                run.env.clear()  # its output, as a call's, dies now
                        else:
                            module(*args, **kwargs)
                    other.claim_pending()
                    other.recording = False
                    runs.append((start, key(start), deaths(start)))
            except Exception as e:  # noqa: BLE001 - this parent offers no spans
                why[SpanPlace(path, "", "").name] = f"no spans of its own forward: {e!r:.200}"
                continue
            finally:
                other.recording = False
            priced = [(r.name, r.op, tuple(r.shapes)) for r in tracker.records[slice(*parent.span)]]
            if not runs[0][1] == runs[1][1] == priced:
                why[SpanPlace(path, "", "").name] = "its traced forward runs other ops than its own"
                continue
            shift = parent.span[0] - runs[1][0]
            out[path] = {n: (a + shift, b + shift) for n, (a, b) in run.ops.items()}
            if runs[0][2] != runs[1][2]:
                held_otherwise.add(path)
    return out, held_otherwise


@contextmanager
def _running_traced(model: torch.nn.Module, traced: dict[str, fx.GraphModule]) -> Iterator[None]:
    """Each module of ``traced`` runs its traced forward (on its live attributes) meanwhile."""

    class Traced(ForwardWrapper):
        def __init__(self, gm: fx.GraphModule) -> None:
            self.gm = gm

        def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = fx.Interpreter(module, graph=self.gm.graph)
            return run.run(*in_order(module, args, kwargs))

    installed: list[tuple[Traced, torch.nn.Module]] = []
    try:
        for path, gm in traced.items():
            wrapper, module = Traced(gm), model.get_submodule(path)
            wrapper.install(module)
            installed.append((wrapper, module))
        yield
    finally:
        for wrapper, module in reversed(installed):
            wrapper.uninstall(module)


# At most this many spans of parents' own forwards in all (dp's time grows fast with candidates:
# a Llama-7B shape of 4 layers offered 483 more, past dp's 60 s limit), outer parents first.
MAX_PARENT_SPANS = 128


def _span_cuts(
    model: torch.nn.Module,
    example_input: Any,
    tracker: _OpTracker,
    parents: dict[str, _Parent],
    refused: dict[str, str],
) -> tuple[list[tuple[str, dict[str, tuple[int, int]], int]], set[str]]:
    """([(path, node ops, cuts)] of each parent to offer spans of, within MAX_PARENT_SPANS;
    those of them whose traced forward drops storages otherwise, ``_parent_node_ops``): level by
    level from the root, every parent of a level at the same most cuts (``spans_of``'s
    ``max_cuts``) the spans left allow, down to 2; the parents left out are noted in
    ``refused``. Node ops are found (a forward of each parent, twice) only for the levels some
    spans are left for: GPT-ref's root takes them all, and running its 36 blocks, attentions
    and MLPs too made a second plan 3.35 s instead of 2.50 s."""
    left = MAX_PARENT_SPANS
    levels: dict[int, list[str]] = defaultdict(list)
    for path in parents:
        levels[path.count(".") + bool(path)].append(path)
    offered, held_otherwise = [], set()
    for depth in sorted(levels):
        paths = levels[depth]
        share = left // len(paths)
        cuts = MAX_SPAN_CUTS
        while cuts >= 2 and cuts * (cuts + 1) // 2 > share:
            cuts -= 1
        if cuts < 2:
            for path in paths:
                refused[SpanPlace(path, "", "").name] = (
                    f"no spans of its own forward: the model's {MAX_PARENT_SPANS} are taken by "
                    f"outer modules"
                )
            continue
        level = {path: parents[path] for path in paths}
        ops, held = _parent_node_ops(model, example_input, tracker, level, refused)
        held_otherwise |= held
        for path, node_ops in ops.items():
            working = sum(b > a for a, b in node_ops.values())
            left -= min(cuts, working) * (min(cuts, working) + 1) // 2
            offered.append((path, node_ops, cuts))
    return offered, held_otherwise


def _with_parent_spans(
    model: torch.nn.Module,
    eg: EagerGraph,
    parents: dict[str, _Parent],
    offered: list[tuple[str, dict[str, tuple[int, int]], int]],
    written: dict[int, set[str | None]],
    refused: dict[str, str],
) -> EagerGraph:
    """``eg`` with the spans of each parent's own forward (``parent_spans.spans_of``) among its
    candidates, named ``path(first..last)``: those no in-place write crosses, that write only
    buffers of the children they call (BatchNorm statistics: an applied span recomputes on
    copies of them, ``planner/inplace.py``, Rule 9). A span some module call or run already is
    keeps that one's name."""
    forbidden = forbidden_cuts(eg.graph)
    places, state = dict(eg.places), dict(eg.state_buffers)
    for path, ops, cuts in offered:  # (_span_cuts)
        parent = model.get_submodule(path)
        prefix = f"{path}." if path else ""
        for first, last, (start, stop), children in spans_of(parents[path].gm, ops, cuts):
            if (start, stop) in places or start in forbidden or stop in forbidden:
                continue
            names = set().union(*(written.get(i, ()) for i in range(start, stop)))
            owned = {
                f"{prefix}{child}.{b}"
                for child in children
                for b, _ in parent.get_submodule(child).named_buffers()
            }
            if not names <= owned:  # state of other modules (or none's: None)
                continue
            place = places[(start, stop)] = SpanPlace(path, first, last)
            if names:
                state[place.name] = tuple(sorted(n[len(prefix) :] for n in names))  # type: ignore[index]
    return replace(
        eg,
        graph=replace(eg.graph, region_spans=frozenset(places)),
        places=places,
        refused={**eg.refused, **refused},
        state_buffers=state,
    )


def _read_by_calls(tracker: _OpTracker) -> None:
    """A storage passed to a module call is read by it, whether or not an op inside reads it:
    checkpointing the call saves every tensor argument until its backward ends (simulate's
    Rule 2). Llama's decoder layers are passed ``position_ids`` that none of their ops read;
    without this a checkpointed layer measured 512 B over the prediction. The call's first
    node stands for the call (never later than the storage already lives: the caller passes
    it)."""
    for start, stop, passed in tracker.call_args:
        if start == stop:
            continue
        for rec in passed:
            if rec.node < 0 or rec.node >= start:
                continue
            if not any(start <= u < stop for u in (*rec.users, *rec.saved_by)):
                rec.users.add(start)


def _candidates(
    model: torch.nn.Module,
    graph: CostGraph,
    calls: dict[str, list[tuple[int, int, bool]]],
    written: dict[int, set[str | None]],
    aliased: set[str],
) -> EagerGraph:
    forbidden = forbidden_cuts(graph)
    places: dict[tuple[int, int], Place] = {}
    refused: dict[str, str] = {}
    state: dict[str, tuple[str, ...]] = {}
    for path, _ in model.named_modules():  # parents first: a shared span keeps the outermost
        made = calls.get(path, [])
        if len(made) != 1:
            if made:
                refused[path] = f"called {len(made)} times per step"
            continue
        start, stop, grad = made[0]
        if stop == start:
            continue
        names = set().union(*(written.get(i, ()) for i in range(start, stop)))
        prefix = f"{path}." if path else ""
        if not grad:
            refused[path] = "runs under torch.no_grad()"
        elif None in names or not all(n.startswith(prefix) for n in names):  # type: ignore[union-attr]
            # recomputation could not run on copies of state outside the module's own buffers
            refused[path] = "writes state in forward that is not its own buffers"
        elif path in aliased:
            # nn.MultiheadAttention takes its packed-projection path when `query is key`; a
            # checkpoint nested in another recomputes it from inputs unpacked one by one, no
            # longer the same object, so it runs other ops than it saved and
            # torch.utils.checkpoint raises (measured on nn.TransformerEncoderLayer).
            refused[path] = "is called with one tensor as several arguments"
        elif start in forbidden or stop in forbidden:
            refused[path] = "an in-place write crosses its boundary"
        else:
            places.setdefault((start, stop), ModulePlace(path))
            if names:  # BatchNorm statistics: updated once, recomputed on copies (Rule 9)
                state[path] = tuple(sorted(n[len(prefix) :] for n in names))  # type: ignore[index]
    for run, (start, stop), names in _sequential_runs(model, calls, written):
        prefix = f"{run.path}." if run.path else ""
        if start in forbidden or stop in forbidden:
            refused[run.name] = "an in-place write crosses its boundary"
        elif None in names or not all(n.startswith(prefix) for n in names):  # type: ignore[union-attr]
            refused[run.name] = "writes state in forward that is not its children's own buffers"
        elif (start, stop) not in places:  # a run a module already spans is that module
            places[(start, stop)] = run
            if names:
                state[run.name] = tuple(sorted(n[len(prefix) :] for n in names))  # type: ignore[index]
    types = {path: type(m).__name__ for path, m in model.named_modules()}
    once = {path: made[0][:2] for path, made in calls.items() if len(made) == 1}
    return EagerGraph(
        graph=replace(graph, region_spans=frozenset(places)),
        places=places,
        refused=refused,
        module_types=types,
        module_spans=once,
        state_buffers=state,
    )


# nn.Sequential's own forward: it runs its children one after the other and nothing else
_SEQUENTIAL_FORWARD = torch.nn.Sequential.forward
# Runs start and end at most this many places in a Sequential (O(n^2) spans for dp: 528 at 32
# cut 58.5% of eager off a 32-child MLP and took dp 4 s); a longer one's runs start and end
# every ceil(n / MAX_RUN_CUTS) children.
MAX_RUN_CUTS = 32


def _sequential_runs(
    model: torch.nn.Module,
    calls: dict[str, list[tuple[int, int, bool]]],
    written: dict[int, set[str | None]],
) -> Iterator[tuple[RunPlace, tuple[int, int], set[str | None]]]:
    """(the run's place, ``path[a:b]``, its node span, state names written) of every run
    of two or more consecutive children of an ``nn.Sequential`` that is not all of them: a
    region ``planner/inplace.py`` applies as one checkpointed call of those children
    (``inplace.RunForward``). Only a Sequential whose forward is nn.Sequential's own (so the
    run's ops are exactly its children's, back to back), called once with grad, whose children
    are each called once, by it. A Sequential of more than MAX_RUN_CUTS children offers the
    runs between every k-th child (k = ceil(n / MAX_RUN_CUTS))."""
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Sequential):
            continue
        if type(module).forward is not _SEQUENTIAL_FORWARD or len(calls.get(path, ())) != 1:
            continue
        n = len(module)
        if n < 3 or not calls[path][0][2]:
            continue
        prefix = f"{path}." if path else ""
        made = [calls.get(f"{prefix}{k}", []) for k in range(n)]
        if any(len(m) != 1 or not m[0][2] for m in made):
            continue
        bounds = [m[0][:2] for m in made]
        if bounds[0][0] != calls[path][0][0] or bounds[-1][1] != calls[path][0][1]:
            continue
        if any(bounds[k][1] != bounds[k + 1][0] for k in range(n - 1)):
            continue
        stride = -(-n // MAX_RUN_CUTS)
        cuts = sorted({*range(0, n, stride), n})
        for i, a in enumerate(cuts):
            for b in cuts[i + 1 :]:
                if b - a < 2 or (a, b) == (0, n):
                    continue  # one child is that child's region; all is the Sequential's
                start, stop = bounds[a][0], bounds[b - 1][1]
                if stop == start:
                    continue
                names = set().union(*(written.get(i, ()) for i in range(start, stop)))
                # a run writes only the buffers of its own children
                own = tuple(f"{prefix}{k}." for k in range(a, b))
                names = {n_ if n_ is None or n_.startswith(own) else None for n_ in names}
                yield RunPlace(path, a, b), (start, stop), names
