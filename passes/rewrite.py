"""Rewrite pass: checkpoint regions of a GraphModule become named submodules.

In: a captured ``torch.fx.GraphModule`` (``passes/capture.py``) and a laminar family of regions
(``passes/regions.py`` ``Region``), each a contiguous run of its call nodes named by fx node
name. Out: a new GraphModule whose code calls every outermost region as
``self.<region.name>(...)``; nested regions are called the same way inside their parent's body.
The input module is left untouched.

Each region runs its nodes (the *body*, a small GraphModule) through
``torch.utils.checkpoint.checkpoint(body, *inputs, use_reentrant=False)`` ('recompute'), with an
op-level policy from ``create_selective_checkpoint_contexts`` that keeps the outputs of
``saved_nodes`` ('selective'), or through ``passes/offload.py``'s ``offloaded_call`` ('offload':
what the body makes and saves waits in host memory; its parameters and inputs stay).

Why it trains exactly like the original:

- Parameters and buffers stay where they were: the parent reads them with its own ``get_attr``
  nodes and passes them into the region as arguments, so the new module shares the model's
  Parameter objects and its ``state_dict()`` keys are unchanged.
- RNG: ``preserve_rng_state`` replays dropout's draws on recompute, for the regions that draw
  random numbers (``Region.preserve_rng_state``; the others neither stash nor restore the
  RNG state, which nothing in them reads); autocast state is replayed by checkpoint itself.
- State written in forward (BatchNorm running statistics, ``num_batches_tracked``, any buffer an
  in-place op writes): the forward pass updates the real buffers once; every recompute runs on
  fresh copies of the values they held before the forward pass, so the recomputed outputs are the
  same bits and the buffers are not updated twice.
- In-place writes to activations a region reads from outside are refused
  (:class:`UnsupportedModelError`): the recompute would read the changed value.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import re
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from planner.passes.nodes import module_path, written_arguments
from planner.passes.offload import offloaded_call
from planner.passes.regions import Region
from planner.solvers.errors import UnsupportedModelError

CALL_OPS = ("call_function", "call_method", "call_module")
KINDS = ("recompute", "selective", "offload")


# --------------------------------------------------------------------------- names


def _identifier(text: str) -> str:
    text = re.sub(r"\W+", "_", text).strip("_")
    return text or "region"


def region_name(gm: fx.GraphModule, nodes: Iterable[str | fx.Node], taken: set[str]) -> str:
    """A readable, unique attribute name for a region, from the modules its nodes ran in.

    The deepest module path common to the nodes, e.g. ``ckpt_blocks_3_attn``; when the region
    covers only part of that module, the range of its children, e.g. ``ckpt_blocks_0_to_3``.
    Unique against ``taken`` and ``gm``'s attributes (suffix ``_2``, ``_3``...). The name is
    not added to ``taken``.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    members = [by_name[n] if isinstance(n, str) else n for n in nodes]
    if not members:
        raise ValueError("a region needs at least one node")
    known = [(n, p.split(".") if p else []) for n in members if (p := module_path(n)) is not None]
    if not known:
        base = f"{members[0].name}_to_{members[-1].name}" if len(members) > 1 else members[0].name
    else:
        parts = [p for _, p in known]
        common: list[str] = []
        for level in zip(*parts):
            if any(x != level[0] for x in level):
                break
            common.append(level[0])
        prefix = ".".join(common)
        # Nodes elsewhere in the graph that ran inside the same module: if there are none,
        # the region is that whole module and the module's name is the region's.
        member_set = set(members)
        whole = all(
            n in member_set
            for n in gm.graph.nodes
            if n.op in CALL_OPS
            and (p := module_path(n)) is not None
            and (p == prefix or p.startswith(prefix + ".") or not prefix)
        )
        children = [p[len(common)] for _, p in known if len(p) > len(common)]
        if whole or not children:
            base = prefix or "model"
        elif children[0] == children[-1]:
            base = ".".join([*common, children[0]])
        else:
            base = ".".join([*common, children[0]]) + "_to_" + children[-1]
    stem = "ckpt_" + _identifier(base)
    name, k = stem, 1
    while name in taken or hasattr(gm, name):
        k += 1
        name = f"{stem}_{k}"
    return name


# --------------------------------------------------------------------------- the region module

_save_state = threading.local()
_SAVE_ANNOTATION = "planner_save_output"


def save_output(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``op``; inside a selective region its outputs are kept for backward, not recomputed."""
    if torch.compiler.is_compiling():
        # Under torch.compile the policy runs later, while AOT autograd replays dynamo's graph
        # node by node; a counter set here at trace time is gone by then. An fx annotation is
        # recorded on the op's node, and the replay makes it the current meta again.
        with fx_traceback.annotate({_SAVE_ANNOTATION: True}):
            return op(*args, **kwargs)
    _save_state.depth = getattr(_save_state, "depth", 0) + 1
    try:
        return op(*args, **kwargs)
    finally:
        _save_state.depth -= 1


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # A saved op may decompose into views of its inputs (matmul expands and reshapes them);
    # caching those views would keep the inputs' storages, e.g. an S x S softmax, alive.
    if getattr(op, "is_view", False):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if getattr(_save_state, "depth", 0) or _annotated_save():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _annotated_save() -> bool:
    """True while torch.compile replays an op that ``save_output`` annotated."""
    return bool(fx_traceback.current_meta.get("custom", {}).get(_SAVE_ANNOTATION))


@contextlib.contextmanager
def _outside_selective_checkpointing() -> Iterator[None]:
    """Without selective checkpointing's dispatch modes (on top of the stack while a selective
    region runs), which would count the ops run here as the region's and try to replay them;
    other modes (a memory tracker's) still see them."""
    popped = []
    sac_modes = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
    while (stack := _get_current_dispatch_mode_stack()) and isinstance(stack[-1], sac_modes):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


class CheckpointRegion(nn.Module):
    """Runs ``body`` (a GraphModule of the region's nodes) under one checkpoint, or, for an
    offload region, through ``offloaded_call`` (``passes/offload.py``, as the in-place form),
    which keeps the arguments (parameters among them) and the buffers and parameters of leaf
    modules ``body`` calls on the device.

    ``body`` is kept out of the module tree on purpose: it holds no parameters of its own, and
    leaf modules it calls (symbolic_trace graphs) are already registered in the parent, so
    ``state_dict()``, ``parameters()`` and ``.to()`` see the model exactly as before.

    ``state_inputs``: argument positions holding buffers the step writes (BatchNorm running
    statistics...); ``state_buffers``: such buffers of leaf modules called inside ``body``.
    ``preserve_rng_state``: checkpoint's own (``Region.preserve_rng_state``).
    """

    def __init__(
        self,
        body: fx.GraphModule,
        kind: str = "recompute",
        state_inputs: tuple[int, ...] = (),
        state_buffers: tuple[str, ...] = (),
        preserve_rng_state: bool = True,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "body", body)
        self.kind = kind
        self.state_inputs = state_inputs
        self.state_buffers = state_buffers
        self.preserve_rng_state = preserve_rng_state

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"

    def forward(self, *args: Any) -> Any:
        body = self.body
        if not torch.is_grad_enabled():
            return body(*args)
        if self.kind == "offload":
            # as the in-place form runs it: only what the body makes goes to host (Rule 7)
            return offloaded_call(body, body, *args)
        # body.forward, not body: checkpoint stops each recomputation early by raising through
        # the body, and GraphModule.__call__ extracts a traceback from every exception that
        # passes (file stats per frame): 0.05-0.1 ms per region and step on a CPU
        fn, args = (
            self._once(args) if self.state_inputs or self.state_buffers else (body.forward, args)
        )
        if self.kind == "selective":
            return checkpoint(
                fn,
                *args,
                use_reentrant=False,
                preserve_rng_state=self.preserve_rng_state,
                context_fn=functools.partial(
                    create_selective_checkpoint_contexts, _selective_policy
                ),
            )
        return checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state
        )

    def _once(self, args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """The body, but every call after the first runs on copies of the pre-step state.

        State inputs are kept out of checkpoint's own arguments: checkpoint saves its
        arguments for backward, and the in-place update would then fail its version check.
        """
        body = self.body
        state = {i: args[i] for i in self.state_inputs}
        before_args = {i: a.detach().clone() for i, a in state.items()}
        before_bufs = {k: body.get_buffer(k).detach().clone() for k in self.state_buffers}
        rest = tuple(a for i, a in enumerate(args) if i not in state)
        # Only the count: the closure lives as long as the checkpoint, and holding ``args``
        # would keep every activation argument alive with it.
        n_args = len(args)
        calls = 0

        def merged(values: dict[int, Any], a: tuple[Any, ...]) -> tuple[Any, ...]:
            it = iter(a)
            return tuple(values[i] if i in values else next(it) for i in range(n_args))

        def run(*a: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return body.forward(*merged(state, a))
            # Bookkeeping copies, not ops of the region (simulate's Rule 9 counts them).
            with _outside_selective_checkpointing():
                full = merged({i: v.clone() for i, v in before_args.items()}, a)
                fresh = {k: v.clone() for k, v in before_bufs.items()}
            if not before_bufs:
                return body.forward(*full)
            return torch.func.functional_call(body, fresh, full, strict=False)

        return run, rest


# --------------------------------------------------------------------------- aliasing, writes

_VIEW_NAMES = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "expand",
    "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "narrow", "select", "split",
    "chunk", "unbind", "as_strided", "detach", "diagonal", "movedim", "swapaxes", "contiguous",
    "__getitem__", "getitem", "real", "imag", "view_as_real", "view_as_complex", "alias",
}  # fmt: skip
_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.setitem,
}  # fmt: skip


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", str(t))


def _arg_value(node: fx.Node, i: int, name: str) -> Any:
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _first_node(val: Any) -> fx.Node | None:
    nodes = _nodes_in(val)
    return nodes[0] if nodes else None


def _nodes_in(val: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(val, out.append)
    return out


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The node whose storage ``node``'s output may alias (views, in-place results)."""
    if node.op not in CALL_OPS:
        return None
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        sets = [r.alias_info.before_set for r in t._schema.returns if r.alias_info is not None]
        for i, a in enumerate(t._schema.arguments):
            if a.alias_info is not None and any(a.alias_info.before_set & s for s in sets):
                return _first_node(_arg_value(node, i, a.name))
        return None
    name = _target_name(node)
    if node.op == "call_module":
        return None
    if (
        name in _VIEW_NAMES
        or t in _INPLACE_OPERATORS
        or (name.endswith("_") and not name.startswith("_"))
    ):
        return _first_node(node.args[:1])
    return None


def _written(node: fx.Node, modules: dict[str, nn.Module]) -> list[fx.Node]:
    """Nodes whose storage ``node`` writes in place: aten ops by ``nodes.written_arguments``;
    in symbolic_trace graphs, ``inplace=True`` modules and calls, ``x.add_(...)``, ``x += y``."""
    if node.op not in CALL_OPS:
        return []
    t = node.target
    if isinstance(t, torch._ops.OpOverload):

        def value_of(i: int, name: str) -> Any:
            return _arg_value(node, i, name)

        return [w for value in written_arguments(t._schema, value_of) for w in _nodes_in(value)]
    if node.op == "call_module":
        mod = modules.get(str(t))
        return _nodes_in(node.args[:1]) if getattr(mod, "inplace", False) is True else []
    name = _target_name(node)
    if (
        t in _INPLACE_OPERATORS
        or node.kwargs.get("inplace") is True
        or (name.endswith("_") and not name.startswith("_"))
    ):
        return _nodes_in(node.args[:1])
    return []


def _bases(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    base: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        src = _alias_source(n)
        base[n] = base.get(src, src) if src is not None else n
    return base


# --------------------------------------------------------------------------- the pass


@dataclass
class _Span:
    region: Region
    start: int
    stop: int
    members: set[fx.Node]
    children: list[_Span]


def node_interval(region: Region, index: Mapping[str, int]) -> tuple[int, int]:
    """[start, stop) of ``region``'s nodes by ``index`` (node name -> position in graph order).

    Raises ``ValueError`` when it names a node ``index`` lacks or its nodes are not a contiguous
    run. The rewrite and ``planner.apply_plan`` both map named regions to intervals here.
    """
    if not region.nodes:
        raise ValueError(f"region {region.name} covers no nodes")
    for name in region.nodes:
        if name not in index:
            raise ValueError(f"region {region.name}: node {name!r} is not in the graph's calls")
    idx = sorted(index[name] for name in region.nodes)
    if idx != list(range(idx[0], idx[-1] + 1)):
        raise ValueError(f"region {region.name}: its nodes are not a contiguous run in graph order")
    return idx[0], idx[-1] + 1


def _spans(gm: fx.GraphModule, regions: Sequence[Region], order: list[fx.Node]) -> list[_Span]:
    """Validate regions and arrange them as a forest (outermost first, in graph order)."""
    index = {n.name: i for i, n in enumerate(order)}
    spans: list[_Span] = []
    seen_names: set[str] = set()
    for r in regions:
        if not r.name.isidentifier() or r.name.startswith("__"):
            raise ValueError(f"region name {r.name!r} is not a valid attribute name")
        if r.name in seen_names or hasattr(gm, r.name):
            raise ValueError(f"region name {r.name!r} is used twice or clashes with the model")
        seen_names.add(r.name)
        if r.kind not in KINDS:
            raise ValueError(f"region {r.name}: kind {r.kind!r} is not one of {KINDS}")
        start, stop = node_interval(r, index)
        if not set(r.saved_nodes) <= set(r.nodes):
            raise ValueError(f"region {r.name}: saved_nodes must be nodes of the region")
        spans.append(_Span(r, start, stop, set(order[start:stop]), []))
    # Laminar: outer regions first (longer first at the same start), then place each inside
    # the innermost region already seen that covers it.
    spans.sort(key=lambda s: (s.start, -s.stop))
    roots: list[_Span] = []
    stack: list[_Span] = []
    for s in spans:
        while stack and not (stack[-1].start <= s.start and s.stop <= stack[-1].stop):
            if s.start < stack[-1].stop:
                raise ValueError(
                    f"regions {stack[-1].region.name} and {s.region.name} overlap without one "
                    f"containing the other"
                )
            stack.pop()
        if stack and (stack[-1].start, stack[-1].stop) == (s.start, s.stop):
            raise ValueError(f"regions {stack[-1].region.name} and {s.region.name} are identical")
        if s.region.depth != len(stack):
            raise ValueError(
                f"region {s.region.name} has depth {s.region.depth} but lies inside "
                f"{len(stack)} region(s)"
            )
        (stack[-1].children if stack else roots).append(s)
        stack.append(s)
    return roots


def _shell(gm: fx.GraphModule) -> fx.GraphModule:
    """A new module of ``gm``'s class sharing its parameters, buffers, submodules and hooks.

    The containers are copied so adding region submodules leaves ``gm`` unchanged; a fresh
    GraphModule class is needed because ``recompile`` installs ``forward`` on the class.
    """
    new = fx.GraphModule.__new__(type(gm))
    state = dict(gm.__dict__)
    for key, val in state.items():
        if isinstance(val, (dict, set, list)):
            state[key] = copy.copy(val)
        elif isinstance(val, types.MethodType) and val.__self__ is gm:
            state[key] = types.MethodType(val.__func__, new)
    new.__dict__.update(state)
    return new


def rewrite(gm: fx.GraphModule, regions: Sequence[Region]) -> fx.GraphModule:
    """Return a copy of ``gm`` in which each region runs as a checkpointed submodule.

    Deterministic: the same ``gm`` and regions give the same code. Raises ``ValueError`` for
    regions that are not contiguous, overlap, or name nodes the graph lacks, and
    :class:`UnsupportedModelError` for patterns that cannot be recomputed exactly.
    """
    order = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    roots = _spans(gm, tuple(regions), order)
    modules = dict(gm.named_modules())
    ctx = _Context(gm, order, modules, _bases(gm.graph))

    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    # Shared, not deep-copied: the codegen (pytree in/out specs) is never mutated.
    graph._codegen = gm.graph._codegen
    new_modules: dict[str, nn.Module] = {}
    env: dict[fx.Node, fx.Node] = {}
    ctx.emit(list(gm.graph.nodes), roots, graph, env, new_modules)

    new = _shell(gm)
    for name, mod in new_modules.items():
        new._modules[name] = mod
    new.graph = graph  # sets the owning module and recompiles
    graph.lint()
    return new


@dataclass
class _Context:
    gm: fx.GraphModule
    order: list[fx.Node]
    modules: dict[str, nn.Module]
    base: dict[fx.Node, fx.Node]

    def emit(
        self,
        nodes: list[fx.Node],
        spans: list[_Span],
        graph: fx.Graph,
        env: dict[fx.Node, fx.Node],
        owner: dict[str, nn.Module],
        saved: frozenset[str] = frozenset(),
    ) -> None:
        """Copy ``nodes`` into ``graph``; each span becomes one call at its last node."""
        span_of = {n: s for s in spans for n in s.members}
        for node in nodes:
            s = span_of.get(node)
            if s is None:
                if node.name in saved and node.op == "call_function":
                    args = (node.target, *fx.node.map_arg(node.args, env.__getitem__))
                    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                    new = graph.create_node(
                        "call_function", save_output, args, kwargs, name=node.name
                    )
                    new.meta = copy.copy(node.meta)
                    env[node] = new
                elif node.name in saved:
                    raise ValueError(
                        f"saved node {node.name} is a {node.op}; only call_function nodes can "
                        f"be saved by a selective region"
                    )
                else:
                    env[node] = graph.node_copy(node, env.__getitem__)
            elif node is self.order[s.stop - 1]:
                self.emit_region(s, graph, env, owner)

    def emit_region(
        self,
        s: _Span,
        graph: fx.Graph,
        env: dict[fx.Node, fx.Node],
        owner: dict[str, nn.Module],
    ) -> None:
        r = s.region
        body_nodes = self.order[s.start : s.stop]
        inputs: list[fx.Node] = []
        for n in body_nodes:
            for a in n.all_input_nodes:
                if a not in s.members and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in body_nodes if any(u not in s.members for u in n.users)]
        state_inputs, state_buffers = self.state_of(s, inputs)

        body = fx.Graph()
        benv: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            p = body.placeholder(a.name)
            p.meta = copy.copy(a.meta)
            benv[a] = p
        body_modules: dict[str, nn.Module] = {}
        if r.kind == "selective":
            nested = {n.name for c in s.children for n in c.members}
            if nested & set(r.saved_nodes):
                raise ValueError(f"region {r.name}: saved_nodes inside a nested region")
        self.emit(body_nodes, s.children, body, benv, body_modules, frozenset(r.saved_nodes))
        if len(outputs) == 1:
            body.output(benv[outputs[0]])
        else:
            body.output(tuple(benv[o] for o in outputs))
        for n in body_nodes:
            if n.op == "call_module" and n.target not in body_modules:
                body_modules[str(n.target)] = self.modules[str(n.target)]
        body_gm = fx.GraphModule(body_modules, body, class_name=r.name)
        owner[r.name] = CheckpointRegion(
            body_gm, r.kind, state_inputs, state_buffers, r.preserve_rng_state
        )

        call = graph.create_node(
            "call_module", r.name, tuple(env[a] for a in inputs), {}, name=r.name
        )
        if len(outputs) == 1:
            env[outputs[0]] = call
            call.meta = copy.copy(outputs[0].meta)
            return
        for i, o in enumerate(outputs):
            item = graph.create_node("call_function", operator.getitem, (call, i), {}, name=o.name)
            item.meta = copy.copy(o.meta)
            env[o] = item

    def state_of(self, s: _Span, inputs: list[fx.Node]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Inputs and leaf-module buffers a recompute of ``s`` must not read after the step
        changed them, or change again; refuse when they are activations."""
        r = s.region
        input_pos = {}
        for i, a in enumerate(inputs):
            input_pos.setdefault(self.base[a], []).append(i)
        state: set[int] = set()
        # Writes inside the region and anywhere after it change what a recompute would read.
        for n in self.order[s.start :]:
            for w in _written(n, self.modules):
                b = self.base[w]
                if b not in input_pos:
                    continue
                if not self.is_state(b):
                    raise UnsupportedModelError(
                        f"node {n.name} ({_target_name(n)}) writes in place to {b.name}, which "
                        f"checkpoint region {r.name} reads from outside; its recompute in "
                        f"backward would see the changed value. Fix: make the op out-of-place "
                        f"(e.g. inplace=False, or x = x + y instead of x += y), or keep "
                        f"{b.name}'s users out of checkpoint regions."
                    )
                state.update(input_pos[b])
        buffers = []
        for n in self.order[s.start : s.stop]:
            if n.op == "call_module":
                mod = self.modules[str(n.target)]
                buffers += [f"{n.target}.{k}" for k, _ in mod.named_buffers()]
        return tuple(sorted(state)), tuple(dict.fromkeys(buffers))

    def is_state(self, node: fx.Node) -> bool:
        """get_attr of a buffer or constant: model state, not an activation."""
        if node.op != "get_attr":
            return False
        val = self.gm
        for part in str(node.target).split("."):
            val = getattr(val, part)
        return isinstance(val, torch.Tensor) and not isinstance(val, nn.Parameter)
