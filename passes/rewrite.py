"""Rewrite pass: checkpoint regions of a GraphModule become named submodules.

In: a captured ``torch.fx.GraphModule`` (``passes/capture.py``) and a laminar family of regions
(``passes/regions.py`` ``Region``), each a contiguous run of its call nodes named by fx node
name. Out: a new GraphModule whose code calls every outermost region as
``self.<region.name>(...)``; nested regions are called the same way inside their parent's body.
The input module is left untouched.

Each region runs its nodes (the *body*, a small GraphModule) as a ``CheckpointRegion``
(``passes/checkpoint_region.py``) through
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
  (:class:`UnsupportedModelError`; what a node writes and aliases: ``passes/nodes.py``): the
  recompute would read the changed value.
"""

from __future__ import annotations

import copy
import operator
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from planner.passes.checkpoint_region import CheckpointRegion, save_output
from planner.passes.nodes import CALL_OPS, module_path, storage_bases, target_name, written_nodes
from planner.passes.regions import Region
from planner.solvers.errors import UnsupportedModelError

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
    ctx = _Context(gm, order, modules, storage_bases(gm.graph))

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
            for w in written_nodes(n, self.modules):
                b = self.base[w]
                if b not in input_pos:
                    continue
                if not self.is_state(b):
                    raise UnsupportedModelError(
                        f"node {n.name} ({target_name(n)}) writes in place to {b.name}, which "
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
