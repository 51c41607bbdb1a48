"""Plans carried out in place on the user's own modules: ``plan(..., form="inplace")``,
``p.apply(model)``, ``planner.apply_plan(model, path)``, ``planner.remove(model)``.

This is the run time; the check that a model is the one planned is ``planner/inplace_check.py``,
a selective region's op-level policy ``planner/inplace_policy.py``; pricing, building and the
form's part of the plan file are ``planner/inplace_form.py``'s, the Plan ``planner/plans.py``'s
and its Region, with the region's place, ``passes/regions.py``'s.

A region is one submodule (every call of it; the planner only offers modules called once per
step), or a run of consecutive children of an ``nn.Sequential`` (``blocks[0:3]``,
``_RunForward``): the Sequential's forward is then ``_SequentialRuns``, which calls its children
in turn as nn.Sequential does, each run as one checkpointed call exactly like a module region's
(nested runs and child regions inside it), or a span of a module's own forward
(``(max_pool2d..down.0)``, ``blocks.0.mlp(fc..proj)``: ``passes/parent_spans.py``): that
module's forward is then ``_ParentSpans``, its torch.fx trace (children as leaves) rewritten by
``passes/rewrite.py`` so that each span is one call, run by the same runner as a module region
(``_SpanForward``) on the module's own attributes and children. A module whose traced forward
drops values earlier than its own code and that lies inside a region runs traced too
(``InplaceTarget.traced_forwards``: the plan was priced so).

Applying a plan replaces each region module's ``forward`` by an instance attribute
(``passes/forward_wrapper.py`` ``ForwardWrapper``) that, when ``torch.is_grad_enabled() and
module.training``, runs the original forward under non-reentrant
``torch.utils.checkpoint.checkpoint`` (RNG state preserved where the region draws random
numbers: ``Region.preserve_rng_state``), and otherwise calls it plainly:
``model.eval()`` and ``torch.no_grad()`` run the model as it was. Nested regions nest
checkpoints because the child's forward is wrapped too.

'selective' regions run an op-level policy (``create_selective_checkpoint_contexts``) keyed by
(op overload, occurrence of that overload within this call's forward), as eager dispatch sees
the ops: MUST_SAVE for the planned keeps, PREFER_RECOMPUTE otherwise (``inplace_policy.Policy``).
Nothing depends on shapes, so any batch and sequence length runs (plan at the largest you train:
memory grows with shape). If a call's op sequence differs from the planned one (data-dependent
control flow), the rest of that call recomputes everything and a warning names the module once.

Applying records the plan on the model (``planner.applied_plan(model)``) and keeps Hugging
Face's own gradient checkpointing out of its way (``planner/hf_checkpointing.py``): turned off
when the plan is applied, refused while it is; ``remove`` undoes both. Training-loop callbacks
that apply a plan and log its peak: ``planner/integrations/``.

Under ``torch.compile`` the same decisions reach AOT autograd's partitioner: dynamo turns a
checkpoint's ``context_fn`` into a Python constant, which a policy object holding run-time
state is not (it graph-broke twice per region and ran the region eager). So while dynamo traces,
the context function is ``functools.partial(_traced_contexts, key)``, a plain function and an
int, and the policy it builds when AOT autograd replays the region is the eager one (by
position), looked up by that key: the partitioner sees the planned ops as MUST_SAVE. AOT
autograd's trace names some ops otherwise than eager dispatch (``traced_ops``: functional for
in-place, ``view`` for ``_unsafe_view``, one ``native_dropout`` for eager CPU's four dropout
ops), so the planned sequence is translated first. Divergence is then detected at compile time
(once per compilation, not per call), and a region that runs fewer ops than planned is not
noticed there.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner import hf_checkpointing
from planner.guard import remove_guard
from planner.inplace_policy import RECOMPUTE, Policy, TracedDecisions
from planner.passes.checkpoint_region import CheckpointRegion, outside_selective_checkpointing
from planner.passes.forward_wrapper import ForwardWrapper
from planner.passes.offload import offloaded_call
from planner.passes.parent_spans import call_nodes, forward_arity, node_labels, trace_parent
from planner.passes.regions import ModulePlace, RunPlace, SpanPlace, parse_place, place_of
from planner.passes.rewrite import rewrite
from planner.plans import Plan, Region


def ModuleRegion(  # noqa: N802 - its name when it was a class of its own
    path: str,
    kind: str = "recompute",
    depth: int = 0,
    keeps: tuple[tuple[str, int], ...] = (),
    ops: tuple[str, ...] = (),
    state_buffers: tuple[str, ...] = (),
) -> Region:
    """The region of an in-place plan at the place ``path`` names (a module's path, a run's
    ``blocks[0:2]``, a span's ``blocks.0(fc..proj)``), with what applying needs and no graph
    nodes: ``planner.Region`` (passes/regions.py)."""
    return Region.at(
        parse_place(path), depth=depth, kind=kind, keeps=keeps, ops=ops, state_buffers=state_buffers
    )


# --------------------------------------------------------------------------- run time


# key -> the wrappers whose decisions a traced context function stands for. Weak: compiled code
# outliving a removed plan must not keep its model alive. Keyed by the decisions, not the
# wrapper: blocks planned alike share one key, so torch.compile per block compiles them once
# (a key per wrapper would fail dynamo's guard on each block: a recompile each, up to dynamo's
# recompile limit, past which it runs eager).
# A str key, not an int: dynamo guards on an int attribute that differs between calls (blocks
# planned differently, compiled per block) by making it a SymInt on the recompile, which
# context_fn cannot hold ("Failed to convert SymNodeVariable() into a Python constant": a graph
# break per such block, tiny GPT-2 at 50%); a str stays a constant.
_TRACED: defaultdict[str, weakref.WeakSet[_RegionForward]] = defaultdict(weakref.WeakSet)
_TRACED_KEYS: dict[tuple[tuple[str, ...], tuple[CheckpointPolicy, ...]], str] = {}


def _traced_contexts(key: str) -> Any:
    """A selective region's checkpoint contexts, as torch.compile builds them: dynamo keeps this
    function and ``key`` as constants, AOT autograd calls it while it traces the region."""
    wrapper = next(iter(_TRACED[key]))  # alive: dynamo is tracing one
    return create_selective_checkpoint_contexts(Policy(TracedDecisions(wrapper)))


class _RegionForward(ForwardWrapper):
    """A region module's forward: checkpointed while training with grad, plain otherwise."""

    def __init__(self, region: Region) -> None:
        self.region = region
        keeps, occurrences = frozenset(region.keeps), defaultdict(int)
        decisions = []
        for op in region.ops:
            keep = (op, occurrences[op]) in keeps
            occurrences[op] += 1
            decisions.append(CheckpointPolicy.MUST_SAVE if keep else RECOMPUTE)
        self.decisions = tuple(decisions)
        self.register()
        # the overload seen at each position, once its name matched the plan's
        self.funcs: list[Any] = [None] * len(region.ops)
        self.warned = False

    def register(self) -> None:
        """Give this wrapper's decisions the key a traced context function names them by."""
        self.key = _TRACED_KEYS.setdefault(
            (self.region.ops, self.decisions), f"planner-region-{len(_TRACED_KEYS)}"
        )
        _TRACED[self.key].add(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy(model) and pickling copy the wrapper: the copy must be found by its key
        # in this process even once the original is gone
        self.__dict__.update(state)
        self.register()

    def expects(self, i: int, func: Any) -> bool:
        """Whether ``func`` is the planned op at position ``i`` of the forward."""
        if i >= len(self.funcs):
            return False
        if self.funcs[i] is func:
            return True
        if str(func) != self.region.ops[i]:
            return False
        self.funcs[i] = func
        return True

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and module.training):
            return self.run_original(module, *args, **kwargs)
        kind = self.region.kind
        if kind == "offload":
            return offloaded_call(
                functools.partial(self.run_original, module, **kwargs), module, *args
            )
        body, tensors = self._positional(module, args, kwargs)
        if self.region.state_buffers:
            body = _updating_once(module, self.region.state_buffers, body)
        # RNG state stashed and replayed only where the region draws random numbers (Rule 12)
        preserve = self.region.preserve_rng_state
        if kind != "selective":
            return checkpoint(body, *tensors, use_reentrant=False, preserve_rng_state=preserve)
        if torch.compiler.is_compiling():
            return checkpoint(
                body,
                *tensors,
                use_reentrant=False,
                preserve_rng_state=preserve,
                context_fn=functools.partial(_traced_contexts, self.key),
            )
        policy = Policy(self)
        out = checkpoint(
            body,
            *tensors,
            use_reentrant=False,
            preserve_rng_state=preserve,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy),
        )
        if not policy.diverged and policy.seen != len(self.region.ops):
            self.diverged(f"it ran {policy.seen} ops, the plan expected {len(self.region.ops)}")
        return out

    def _positional(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        """The call as ``body(*tensors)``: every tensor argument, keyword or inside a container,
        a positional argument of the checkpoint, the rest bound in ``body``.

        A checkpoint saves its positional tensors for its recomputation through its parent's
        hooks, which drop them when it is nested in another checkpoint (simulate's Rule 3). Any
        other argument its frame holds itself: passed as is, a keyword tensor (Hugging Face
        calls ``self_attn(hidden_states=...)``) lived from a nested region's forward to the
        end of its backward, 66 KB over the prediction on a tiny Llama."""
        tensors, template, slots, spec = _tensor_leaves((args, kwargs))

        def body(*ts: torch.Tensor) -> Any:
            filled = list(template)
            for i, t in zip(slots, ts, strict=True):
                filled[i] = t
            call_args, call_kwargs = tree_unflatten(filled, spec)
            return self.run_original(module, *call_args, **call_kwargs)

        return body, tensors

    def diverged(self, detail: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"planner: module {self.region.path!r} ran other operations than planned "
                f"({detail}); data-dependent control flow? The rest of such calls recompute "
                f"everything, so memory may differ from the prediction. Plan with an input that "
                f"takes the same path you train with.",
                stacklevel=3,
            )


def _tensor_leaves(
    tree: Any,
) -> tuple[list[torch.Tensor], list[Any], list[int], Any]:
    """The tensors of ``tree``, the leaves with None in their place, their slots and the tree's
    spec. A function of its own so that no frame that makes a closure holds the leaves (nor a
    ``del`` of them, which dynamo cannot trace: DELETE_DEREF)."""
    leaves, spec = tree_flatten(tree)
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    return [leaves[i] for i in slots], template, slots, spec


def _updating_once(
    module: torch.nn.Module, names: tuple[str, ...], body: Callable[..., Any]
) -> Callable[..., Any]:
    """``body``, but every call after the first (checkpoint's recomputations) runs on fresh
    copies of the values ``names`` (buffers of ``module``) held before the step, so BatchNorm
    statistics are updated once and the recomputed outputs are the same bits (as
    ``passes/checkpoint_region.py`` ``CheckpointRegion._once``; simulate's Rule 9 prices the
    copies)."""
    before = {n: module.get_buffer(n).detach().clone() for n in names}
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return body(*args)
        with outside_selective_checkpointing():  # bookkeeping, not ops of the region
            fresh = {n: v.clone() for n, v in before.items()}
        with _reparametrize_module(module, fresh):
            return body(*args)

    return run


def apply_regions(
    model: torch.nn.Module,
    regions: tuple[Region, ...],
    plan: Plan | None = None,
    traced_forwards: tuple[str, ...] = (),
) -> torch.nn.Module:
    """Wrap each region's module of ``model`` in place (any earlier plan is removed first), and
    record ``plan`` on it, Hugging Face's own checkpointing turned off (hf_checkpointing.py).
    ``traced_forwards``: modules that run their traced forward (``_ParentSpans``) even without
    a span of their own, as the plan priced them."""
    remove(model)
    wrap = functools.partial(wrap_regions, traced_forwards=traced_forwards)
    wrap(model, regions)
    hf_checkpointing.mark_applied(model, plan, regions, wrap, unwrap_regions)
    return model


class _RunForward(_RegionForward):
    """A run region: children ``[a:b]`` of an nn.Sequential called as one checkpointed call,
    exactly as a module region (``_RegionForward.__call__``, with the Sequential as the module:
    its BatchNorm statistics are named relative to it); the runs nested in it run inside."""

    def __init__(self, region: Region, runs: _SequentialRuns, children: slice) -> None:
        super().__init__(region)
        self.runs, self.children = runs, children

    def run_original(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        (x,) = args  # nn.Sequential.forward takes one input
        return self.runs.run_children(module, self.children.start, self.children.stop, x)


class _SequentialRuns(ForwardWrapper):
    """An nn.Sequential's forward with its planned runs (``_RunForward``): its children called
    one after the other, as nn.Sequential's own forward does, each run as one call. Installed
    under a region wrapping the Sequential itself, if any (``wrap_regions``)."""

    def __init__(self) -> None:
        self.calls: dict[tuple[int, int], _RunForward] = {}
        # (a, b) -> what running children [a:b] calls in turn: (child, None) or a run (k, stop)
        self.steps: dict[tuple[int, int], tuple[tuple[int, int | None], ...]] = {}

    def plan_steps(self, n: int) -> None:
        """Fix each context's calls once the runs are known (not per call: torch.compile then
        traces plain loops). Runs form a laminar family: in each context, the outermost run
        starting at a child is called, its children inside it."""
        for a, b in (*self.calls, (0, n)):
            steps, k = [], a
            while k < b:
                inner = [hi for lo, hi in self.calls if lo == k and hi <= b and (lo, hi) != (a, b)]
                stop = max(inner) if inner else None
                steps.append((k, stop))
                k = k + 1 if stop is None else stop
            self.steps[(a, b)] = tuple(steps)

    def run_children(self, module: torch.nn.Module, a: int, b: int, x: Any) -> Any:
        for k, stop in self.steps[(a, b)]:
            x = module[k](x) if stop is None else self.calls[(k, stop)](module, x)
        return x

    def __call__(self, module: torch.nn.Module, input: Any) -> Any:  # noqa: A002 - Sequential's
        return self.run_children(module, 0, len(module), input)


class _SpanForward(_RegionForward):
    """A span region of a parent's forward: its nodes (``body``, a GraphModule of them that
    ``passes/rewrite.py`` cut out of the parent's traced graph) run as one checkpointed call,
    exactly as a module region's (``_RegionForward.__call__``, with the parent as the module:
    its BatchNorm statistics are named relative to it); the spans nested in it run inside."""

    def __init__(self, region: Region, body: torch.nn.Module) -> None:
        super().__init__(region)
        self.body = body

    def run_original(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.body(*args, **kwargs)


class _SpanCall(torch.nn.Module):
    """What the rewritten graph calls for a span (in the place of its ``CheckpointRegion``)."""

    def __init__(self, span: _SpanForward, parent: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "span", span)  # plain attributes: no submodules of the model
        object.__setattr__(self, "parent", weakref.ref(parent))  # its graph is kept by it

    def forward(self, *args: Any) -> Any:
        return self.span(self.parent(), *args)


class _OnModule:
    """``self`` for the rewritten forward: the parent's own attributes as they are at the call
    (its parameters, children), the rewritten graph's span calls and constants besides."""

    def __init__(self, module: torch.nn.Module, gm: torch.fx.GraphModule) -> None:
        self._module, self._gm = module, gm

    def __getattr__(self, name: str) -> Any:
        if not isinstance(self._gm._modules.get(name), _SpanCall) and hasattr(self._module, name):
            return getattr(self._module, name)
        return getattr(self._gm, name)


class _ParentSpans(ForwardWrapper):
    """A parent module's forward with its planned spans (``passes/parent_spans.py``): its
    traced graph, rewritten by ``passes/rewrite.py`` so that each span is one call
    (``_SpanForward``), run on the module itself; its call nodes reach the module's own
    children, so regions of theirs nested in a span run inside it. Used only while training
    with grad, for a call passing one tensor to each forward parameter, as planned; any other
    call runs the module's own forward (warning once when training: its spans do not run).

    The rewritten graph is built per module object (``copy.deepcopy(model)`` shares this
    wrapper, rebound to the copy, whose graph must call the copy's children)."""

    def __init__(self, module: torch.nn.Module, path: str, regions: list[Region]) -> None:
        self.path, self.regions = path, tuple(regions)
        self.arity, self.warned = forward_arity(module), False
        self.built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.rewritten(module)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "built"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, built=weakref.WeakKeyDictionary())

    def rewritten(self, module: torch.nn.Module) -> torch.fx.GraphModule:
        """``module``'s traced forward with each planned span one call, built once."""
        gm = self.built.get(module)
        if gm is not None:
            return gm
        gm = trace_parent(module)
        order, labels = [n.name for n in call_nodes(gm)], node_labels(gm)
        named, by_name, stack = [], {}, []
        for k, r in enumerate(sorted(self.regions, key=lambda r: _outer_first(r, labels))):
            a, b = _node_span(r, labels)
            while stack and stack[-1] < b:  # depth among this parent's spans
                stack.pop()
            name = f"ckpt_span_{k}"
            named.append(Region(name, tuple(order[a:b]), len(stack), r.kind))
            by_name[name] = r
            stack.append(b)
        gm = self.built[module] = rewrite(gm, named)
        _swap_spans(gm, by_name, module)
        return gm

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and module.training):
            return self.run_original(module, *args, **kwargs)
        values = (*args, *kwargs.values())
        if len(values) != self.arity or not all(isinstance(v, torch.Tensor) for v in values):
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"planner: module {self.path!r} was planned with regions of its own forward "
                    f"for calls passing a tensor to each of its {self.arity} parameters; this "
                    f"call does not, so it runs its own forward without them and memory may "
                    f"exceed the prediction.",
                    stacklevel=3,
                )
            return self.run_original(module, *args, **kwargs)
        gm = self.rewritten(module)
        return type(gm).forward(_OnModule(module, gm), *args, **kwargs)


def _node_span(region: Region, labels: list[str]) -> tuple[int, int]:
    """[a, b) of a span region's fx call nodes, labelled ``labels`` in order."""
    span = region.place
    assert isinstance(span, SpanPlace)
    return labels.index(span.first), labels.index(span.last) + 1


def _outer_first(region: Region, labels: list[str]) -> tuple[int, int]:
    a, b = _node_span(region, labels)
    return a, -b


def _swap_spans(
    gm: torch.fx.GraphModule, by_name: dict[str, Region], parent: torch.nn.Module
) -> None:
    """Replace each ``CheckpointRegion`` the rewrite made (nested ones in their parent span's
    body) by the in-place runner of its span."""
    for name, mod in list(gm._modules.items()):
        if isinstance(mod, CheckpointRegion):
            _swap_spans(mod.body, by_name, parent)
            gm._modules[name] = _SpanCall(_SpanForward(by_name[name], mod.body), parent)


def wrap_regions(
    model: torch.nn.Module, regions: tuple[Region, ...], traced_forwards: tuple[str, ...] = ()
) -> None:
    regions = tuple(replace(r, place=place_of(r)) for r in regions)
    # spans first, then runs: a region over the whole module wraps the forward that runs them
    parents: dict[str, list[Region]] = {path: [] for path in traced_forwards}
    for region in regions:
        if isinstance(span := region.place, SpanPlace):
            parents.setdefault(span.path, []).append(region)
    for path, spans in parents.items():
        module = model.get_submodule(path)
        _ParentSpans(module, path, spans).install(module)
    sequentials: dict[str, _SequentialRuns] = {}
    for region in regions:
        if isinstance(run := region.place, RunPlace):
            runs = sequentials.get(run.path)
            if runs is None:
                runs = sequentials[run.path] = _SequentialRuns()
                runs.install(model.get_submodule(run.path))
            children = slice(run.start, run.stop)
            runs.calls[(run.start, run.stop)] = _RunForward(region, runs, children)
    for path, runs in sequentials.items():
        runs.plan_steps(len(model.get_submodule(path)))
    for region in regions:
        if isinstance(place := region.place, ModulePlace):
            _RegionForward(region).install(model.get_submodule(place.path))


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Undo an applied plan: every wrapped module runs its own forward again, and the shape
    guard is gone. Same object."""
    remove_guard(model)
    hf_checkpointing.unmark(model)
    unwrap_regions(model)
    return model


def unwrap_regions(model: torch.nn.Module) -> None:
    for module in model.modules():
        # a region over a Sequential wraps the forward that runs its runs: both come off
        while isinstance(
            wrapper := getattr(module.__dict__.get("forward"), "__func__", None),
            _RegionForward | _SequentialRuns | _ParentSpans,
        ):
            wrapper.uninstall(module)
