"""Plans carried out in place on the user's own modules: ``plan(..., form="inplace")``,
``p.apply(model)``, ``planner.apply_plan(model, path)``, ``planner.remove(model)``.

A region is one submodule (every call of it; the planner only offers modules called once per
step). Applying a plan replaces each region module's ``forward`` by an instance attribute
(``passes/eager.py`` ``ForwardWrapper``) that, when ``torch.is_grad_enabled() and
module.training``, runs the original forward under non-reentrant
``torch.utils.checkpoint.checkpoint`` (RNG state preserved), and otherwise calls it plainly:
``model.eval()`` and ``torch.no_grad()`` run the model as it was. Nested regions nest
checkpoints because the child's forward is wrapped too.

'selective' regions run an op-level policy (``create_selective_checkpoint_contexts``) keyed by
(op overload, occurrence of that overload within this call's forward), as eager dispatch sees
the ops: MUST_SAVE for the planned keeps, PREFER_RECOMPUTE otherwise. Nothing depends on shapes,
so any batch and sequence length runs (plan at the largest you train: memory grows with shape).
If a call's op sequence differs from the planned one (data-dependent control flow), the rest of
that call recomputes everything and a warning names the module once.

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
autograd's trace names some ops otherwise than eager dispatch (``_traced_ops``: functional for
in-place, ``view`` for ``_unsafe_view``, one ``native_dropout`` for eager CPU's four dropout
ops), so the planned sequence is translated first. Divergence is then detected at compile time
(once per compilation, not per call), and a region that runs fewer ops than planned is not
noticed there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
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
from planner.calibration import (
    Calibration,
    CalibrationTimer,
    model_dtype,
    pricing_key,
    reuse_priced,
)
from planner.devices import DeviceProfile
from planner.fsdp import FSDPConfig, per_rank
from planner.guard import PlannedShape, install_guard, planned_shape, remove_guard
from planner.measurement import measured_step_time
from planner.offload import offloaded_call
from planner.passes.eager import EagerGraph, ForwardWrapper, eager_graph
from planner.passes.rewrite import NamedRegion as Region
from planner.passes.rewrite import _outside_selective_checkpointing
from planner.passes.step import LossFn
from planner.plan_file import FORMAT, VERSION, _checksum, read_plan_body
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.errors import PlanFileError, PlannerError, UnsupportedModelError
from planner.solvers.registry import get_solver
from planner.solvers.simulate import Simulation, simulate

FORM = "inplace"
SPAN_SOLVERS = ("auto", "dp", "ilp", "none")  # the solvers that keep to CostGraph.region_spans


@dataclass(frozen=True)
class ModuleRegion:
    """What applying needs of one region: no graph, no shapes.

    ``keeps``: (op overload, occurrence within the call) of the ops whose outputs a selective
    region keeps; ``ops``: the overloads its forward was planned to run, in order (the ops a
    selective-checkpoint policy is asked about), to detect divergence at run time.
    """

    path: str
    kind: str = "recompute"
    depth: int = 0
    keeps: tuple[tuple[str, int], ...] = ()
    ops: tuple[str, ...] = ()
    # buffers its forward writes (BatchNorm statistics), relative to it: recomputed on copies
    state_buffers: tuple[str, ...] = ()


@dataclass(frozen=True)
class InplacePlan:
    """A plan carried out on the model's own modules (``p.apply(model)``).

    Bytes are peak bytes of one forward+loss+backward step above the pre-step baseline
    (DESIGN.md), predicted on what eager runs. ``regions`` name module paths; their ``nodes``
    are the op nodes (``blocks.0.attn:addmm:2``) of the eager CostGraph.
    """

    solver: str
    regions: tuple[Region, ...]
    module_regions: tuple[ModuleRegion, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    predicted_recompute_flops: int
    step_flops: int
    model_class: str
    module_tree: tuple[tuple[str, str], ...] = field(repr=False)
    graph: CostGraph | None = field(default=None, repr=False)
    schedule: Schedule | None = field(default=None, repr=False)
    simulation: Simulation | None = field(default=None, repr=False)
    solve_time_s: float = field(default=0.0, repr=False)
    # (name, shape) of every parameter: a plan never applies to a model of other widths
    # (empty: a file saved before they were recorded, not checked)
    parameter_shapes: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), repr=False)
    precision: str = ""  # the dtypes it was priced in (passes/step.py precision_text)
    # the example input's shape and how the peak scales off it (planner/guard.py); None for a
    # plan built without an example input or read from a file saved before plans recorded it
    planned_shape: PlannedShape | None = field(default=None, repr=False)
    # plan(..., compiled=True): solved flat against budget_bytes * (1 - compiled_margin)
    # (planner/compiled.py); 0.0 for an eager plan and for a plan read from a file
    compiled_margin: float = field(default=0.0, repr=False)

    form = FORM

    @property
    def module(self) -> torch.nn.Module:
        raise PlannerError(
            "an in-place plan has no separate module: apply it to your model with "
            "p.apply(model) (or planner.apply_plan(model, path)), and train the model itself; "
            "plan with form='graph' for a GraphModule"
        )

    @property
    def predicted_recompute_time_s(self) -> float:
        return 0.0 if self.simulation is None else self.simulation.recompute_time_s

    @property
    def predicted_step_time_s(self) -> float:
        """Forward + backward + recomputation + checkpoint overhead of one step, in seconds
        (0 for a plan read from a file: it was not priced here)."""
        return 0.0 if self.simulation is None else self.simulation.step_time_s

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model``'s own region modules in place; returns the same object. The model
        warns once (``planner.OverShapeWarning``) when called with a larger input than
        planned."""
        check_fits(
            model,
            self.model_class,
            self.module_tree,
            self.module_regions,
            "the plan",
            self.parameter_shapes,
        )
        apply_regions(model, self.module_regions, self)
        install_guard(model, self.planned_shape, self.budget_bytes)
        return model

    def summary(self, verbose: bool = False) -> str:
        """A table of the regions and the predicted memory and recompute cost (``verbose``:
        what the solver reported too, as ``Plan.summary``)."""
        from planner.report import plan_summary

        return plan_summary(self, verbose=verbose)  # type: ignore[arg-type]

    def save(self, path: str | Path) -> None:
        """Write a JSON that ``planner.apply_plan(model, path)`` applies in place."""
        save_inplace(self, path)


def module_tree(model: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    return tuple((path, type(m).__name__) for path, m in model.named_modules())


def parameter_shapes(model: torch.nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def check_span_solver(solver: str) -> None:
    """UnsupportedModelError for a solver whose regions need not be module calls."""
    get_solver(solver)  # an unknown name fails with the registry's own message
    if solver not in SPAN_SOLVERS:
        raise UnsupportedModelError(
            f"solver {solver!r} places regions between arbitrary nodes; an in-place plan's "
            f"regions are module calls, which only {', '.join(map(repr, SPAN_SOLVERS))} keep "
            f"to. Use one of those, or plan with form='graph'."
        )


def price_inplace(
    model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
    *,
    device: DeviceProfile | None = None,
    fsdp: FSDPConfig | None = None,
    calibration: Calibration | str | Path | None = None,
) -> EagerGraph:
    """Price ``model``'s eager step for an in-place plan.

    ``device``: the profile to price time for; None prices the model's own device, from its
    calibration (``planner/calibration.py``: its ops timed there once, as ``planning.price``
    does for a graph). ``calibration``: pin one (a ``Calibration`` or the path of one).
    ``fsdp``: price one rank of FSDP2 sharding instead of one process holding the whole model
    (``planner/fsdp.py``).
    """
    on_device = any(p.device.type != "meta" for p in model.parameters())
    time_ops = device is None and on_device

    def make() -> EagerGraph:
        with hf_checkpointing.paused(model):
            eg = eager_graph(
                model,
                example_input,
                loss_fn,
                rates=device,
                time_ops=time_ops,
                timer=CalibrationTimer(
                    model_dtype(model),
                    calibration,
                    step=lambda clock: measured_step_time(
                        model, example_input, loss_fn, clock=clock
                    ),
                )
                if time_ops
                else None,
            )
        return eg if fsdp is None else per_rank(model, eg, fsdp)

    # the same model and input shapes priced earlier in this process: the same pricing
    key = pricing_key(model, example_input, calibration, "inplace", loss_fn, device, fsdp)
    return reuse_priced(key, model, make)


def build_inplace_plan(
    model: torch.nn.Module,
    eg: EagerGraph,
    schedule: Schedule,
    budget_bytes: int,
    *,
    solve_time_s: float = 0.0,
    example_input: Any = None,
) -> InplacePlan:
    """The plan for ``schedule``; ``example_input``: the input it was priced on, recorded so
    that the applied model can tell a larger one (planner/guard.py)."""
    graph = eg.graph
    simulation = simulate(graph, schedule)  # validates: regions are module spans
    regions, module_regions = [], []
    for r in sorted(schedule.regions, key=lambda r: (r.start, -r.stop)):
        path = eg.spans[(r.start, r.stop)]
        saved = sorted(r.saved_nodes)
        regions.append(
            Region(
                name=path,
                nodes=tuple(graph.nodes[i].name for i in range(r.start, r.stop)),
                depth=r.depth,
                kind=r.kind,
                saved_nodes=tuple(graph.nodes[i].name for i in saved),
            )
        )
        module_regions.append(
            ModuleRegion(
                path=path,
                kind=r.kind,
                depth=r.depth,
                keeps=tuple(eg.op_key(i, r.start) for i in saved),
                ops=tuple(eg.op_sequence(r.start, r.stop)),
                state_buffers=eg.state_buffers.get(path, ()),
            )
        )
    return InplacePlan(
        regions=tuple(regions),
        module_regions=tuple(module_regions),
        model_class=type(model).__name__,
        module_tree=module_tree(model),
        parameter_shapes=parameter_shapes(model),
        precision=eg.graph.meta.get("precision", ""),
        solve_time_s=solve_time_s,
        planned_shape=(
            None
            if example_input is None
            else planned_shape(example_input, graph, simulation.peak_bytes)
        ),
        **predictions(graph, schedule, simulation, budget_bytes),
    )


def predictions(
    graph: CostGraph, schedule: Schedule, simulation: Simulation, budget_bytes: int
) -> dict[str, Any]:
    """The fields a plan of either form (Plan, InplacePlan) takes from its solve."""
    return dict(
        solver=schedule.solver,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=simulation.peak_bytes,
        baseline_peak_bytes=simulate(graph, Schedule()).peak_bytes,
        predicted_recompute_flops=simulation.recompute_flops,
        step_flops=graph.step_flops,
        graph=graph,
        schedule=schedule,
        simulation=simulation,
    )


# --------------------------------------------------------------------------- run time


class _Policy:
    """One checkpoint call's selective policy: keep or recompute the op at each position of the
    forward, as planned for that position's (overload, occurrence).

    Positions, not (overload, occurrence) keys, at run time: a policy is asked about every op of
    the region, and a list index costs a fraction of building and hashing a key (measured: a
    policy keyed per call made a step 3.5% slower than torch's own list policy on a small
    GPT). The recomputation repeats the forward's decisions position by position (older torch
    asks the policy on both sides; torch >= 2.10 replays the forward's decisions itself), so
    both sides agree even after a divergence."""

    def __init__(self, wrapper: _RegionForward) -> None:
        self.wrapper = wrapper
        self.seen = 0
        self.recomputed = 0
        self.diverged = False
        self.decisions: list[CheckpointPolicy] = []

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:
            i, self.recomputed = self.recomputed, self.recomputed + 1
            return self.decisions[i] if i < len(self.decisions) else _RECOMPUTE
        i, self.seen = self.seen, self.seen + 1
        wrapper = self.wrapper
        if not self.diverged and not wrapper.expects(i, func):
            self.diverged = True
            planned = wrapper.region.ops
            wrapper.diverged(
                f"op {i} is {func}, the plan expected "
                + (planned[i] if i < len(planned) else "no more ops")
            )
        decision = _RECOMPUTE if self.diverged else wrapper.decisions[i]
        self.decisions.append(decision)
        return decision


_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE


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
    return create_selective_checkpoint_contexts(_Policy(_TracedDecisions(wrapper)))


# Eager CPU dropout (training) dispatches these four; AOT autograd's trace one native_dropout.
_EAGER_DROPOUT = (
    "aten.empty_like.default",
    "aten.bernoulli_.float",
    "aten.div_.Scalar",
    "aten.mul.Tensor",
)
_NATIVE_DROPOUT = "aten.native_dropout.default"


def _traced_name(op: str) -> str:
    """An op's name as AOT autograd's functionalized trace dispatches it."""
    parts = op.split(".")
    if len(parts) == 3:
        name = parts[1]
        if name == "_unsafe_view":
            name = "view"
        elif name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # functionalization: add_ -> add
        parts[1] = name
    return ".".join(parts)


def _traced_ops(
    ops: tuple[str, ...], decisions: tuple[CheckpointPolicy, ...]
) -> tuple[tuple[str, ...], tuple[CheckpointPolicy, ...]]:
    """The planned sequence and decisions as AOT autograd's trace sees the region's ops."""
    names, kept = [], []
    i = 0
    while i < len(ops):
        if ops[i : i + len(_EAGER_DROPOUT)] == _EAGER_DROPOUT:
            step = len(_EAGER_DROPOUT)
            names.append(_NATIVE_DROPOUT)
            kept.append(decisions[i + step - 1])  # the dropout's output is the mul's
        else:
            step = 1
            names.append(_traced_name(ops[i]))
            kept.append(decisions[i])
        i += step
    return tuple(names), tuple(kept)


class _TracedDecisions:
    """A region's planned ops and decisions as AOT autograd's trace sees them (``_Policy``
    asks it as it asks the eager wrapper); divergence warns through the wrapper, once."""

    def __init__(self, wrapper: _RegionForward) -> None:
        ops, self.decisions = _traced_ops(wrapper.region.ops, wrapper.decisions)
        self.region = replace(wrapper.region, ops=ops)
        self.diverged = wrapper.diverged

    def expects(self, i: int, func: Any) -> bool:
        return i < len(self.region.ops) and _traced_name(str(func)) == self.region.ops[i]


class _RegionForward(ForwardWrapper):
    """A region module's forward: checkpointed while training with grad, plain otherwise."""

    def __init__(self, region: ModuleRegion) -> None:
        self.region = region
        keeps, occurrences = frozenset(region.keeps), defaultdict(int)
        decisions = []
        for op in region.ops:
            keep = (op, occurrences[op]) in keeps
            occurrences[op] += 1
            decisions.append(CheckpointPolicy.MUST_SAVE if keep else _RECOMPUTE)
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
        if kind != "selective":
            return checkpoint(body, *tensors, use_reentrant=False, preserve_rng_state=True)
        if torch.compiler.is_compiling():
            return checkpoint(
                body,
                *tensors,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=functools.partial(_traced_contexts, self.key),
            )
        policy = _Policy(self)
        out = checkpoint(
            body,
            *tensors,
            use_reentrant=False,
            preserve_rng_state=True,
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
    ``passes/rewrite.py`` ``CheckpointRegion._once``; simulate's Rule 9 prices the copies)."""
    before = {n: module.get_buffer(n).detach().clone() for n in names}
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return body(*args)
        with _outside_selective_checkpointing():  # bookkeeping, not ops of the region
            fresh = {n: v.clone() for n, v in before.items()}
        with _reparametrize_module(module, fresh):
            return body(*args)

    return run


def apply_regions(
    model: torch.nn.Module, regions: tuple[ModuleRegion, ...], plan: InplacePlan | None = None
) -> torch.nn.Module:
    """Wrap each region's module of ``model`` in place (any earlier plan is removed first), and
    record ``plan`` on it, Hugging Face's own checkpointing turned off (hf_checkpointing.py)."""
    remove(model)
    wrap_regions(model, regions)
    hf_checkpointing.mark_applied(model, plan, regions)
    return model


def wrap_regions(model: torch.nn.Module, regions: tuple[ModuleRegion, ...]) -> None:
    for region in regions:
        _RegionForward(region).install(model.get_submodule(region.path))


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Undo an applied plan: every wrapped module runs its own forward again, and the shape
    guard is gone. Same object."""
    remove_guard(model)
    hf_checkpointing.unmark(model)
    unwrap_regions(model)
    return model


def unwrap_regions(model: torch.nn.Module) -> None:
    for module in model.modules():
        own = module.__dict__.get("forward")
        wrapper = getattr(own, "__func__", None)
        if isinstance(wrapper, _RegionForward):
            wrapper.uninstall(module)


def check_fits(
    model: torch.nn.Module,
    model_class: str,
    tree: tuple[tuple[str, str], ...],
    regions: tuple[ModuleRegion, ...],
    source: str,
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = (),
) -> None:
    """PlanFileError naming the first way ``model`` differs from the one ``source`` was made
    for: its class, a region's module path or class, any module of the tree, then the first
    parameter whose shape differs (``shapes``; empty: not checked)."""
    fix = "Plan this model with planner.plan(..., form='inplace') and save that plan."
    if type(model).__name__ != model_class:
        raise PlanFileError(
            f"{source} was made for a {model_class}, this model is a {type(model).__name__}. {fix}"
        )
    types = dict(tree)
    for r in regions:
        try:
            module = model.get_submodule(r.path)
        except AttributeError:
            raise PlanFileError(
                f"{source} checkpoints module {r.path!r}, which this model does not have. {fix}"
            ) from None
        if type(module).__name__ != types.get(r.path):
            raise PlanFileError(
                f"{source} checkpoints {r.path!r} as a {types.get(r.path)}, in this model it is "
                f"a {type(module).__name__}. {fix}"
            )
    ours = module_tree(model)
    for (path, kind), (their_path, their_kind) in zip(tree, ours):
        if (path, kind) != (their_path, their_kind):
            raise PlanFileError(
                f"{source}'s module tree differs from this model's: {path!r} ({kind}) there, "
                f"{their_path!r} ({their_kind}) here. {fix}"
            )
    if len(tree) != len(ours):
        raise PlanFileError(
            f"{source}'s module tree has {len(tree)} modules, this model {len(ours)}. {fix}"
        )
    if shapes:
        _check_shapes(model, shapes, source, fix)


def _check_shapes(
    model: torch.nn.Module, shapes: tuple[tuple[str, tuple[int, ...]], ...], source: str, fix: str
) -> None:
    # The same module tree at another width prices other bytes: the plan would not hold.
    ours = dict(parameter_shapes(model))
    for name, shape in shapes:
        here = ours.pop(name, None)
        if here != shape:
            this = "does not have it" if here is None else f"has {list(here)}"
            raise PlanFileError(
                f"{source} was made for parameter {name!r} of shape {list(shape)}, this model "
                f"{this}. {fix}"
            )
    if ours:
        name = next(iter(ours))
        raise PlanFileError(f"{source} was made for a model without parameter {name!r}. {fix}")


# --------------------------------------------------------------------------- plan files


def _tree_hash(tree: tuple[tuple[str, str], ...]) -> str:
    return hashlib.sha256(json.dumps(tree).encode()).hexdigest()


def save_inplace(plan: InplacePlan, path: str | Path) -> None:
    body = {
        "format": FORMAT,
        "version": VERSION,
        "form": FORM,
        "torch_version": torch.__version__,
        "model_class": plan.model_class,
        "fingerprint": _tree_hash(plan.module_tree),
        "module_tree": [list(m) for m in plan.module_tree],
        "parameter_shapes": [[name, list(shape)] for name, shape in plan.parameter_shapes],
        "precision": plan.precision,
        "solver": plan.solver,
        "budget_bytes": plan.budget_bytes,
        "regions": [
            {
                "module": m.path,
                "kind": m.kind,
                "depth": m.depth,
                "keeps": [list(k) for k in m.keeps],
                "ops": list(m.ops),
                "state_buffers": list(m.state_buffers),
                "nodes": list(r.nodes),
                "saved_nodes": list(r.saved_nodes),
            }
            for m, r in zip(plan.module_regions, plan.regions)
        ],
        "predictions": {
            "peak_bytes": plan.predicted_peak_bytes,
            "baseline_peak_bytes": plan.baseline_peak_bytes,
            "recompute_flops": plan.predicted_recompute_flops,
            "step_flops": plan.step_flops,
        },
        "planned_shape": None
        if (shape := plan.planned_shape) is None
        else {
            "shape": list(shape.shape),
            "predicted_peak_bytes": shape.predicted_peak_bytes,
            "fixed_bytes": shape.fixed_bytes,
            "attention_share": shape.attention_share,
        },
    }
    body["checksum"] = _checksum(body)
    Path(path).write_text(json.dumps(body, indent=1) + "\n")


def load_inplace(path: str | Path) -> InplacePlan:
    """Read an in-place plan file (no graph: the predictions are the saved ones)."""
    body = read_plan_body(path)
    if body.get("form") != FORM:
        raise PlanFileError(
            f"{path} holds a graph plan (regions of a captured graph), which needs the model's "
            f"example input: planner.apply_plan(model, path, example_input). To apply a plan "
            f"in place, plan with planner.plan(..., form='inplace') and save that."
        )
    try:
        tree = tuple((str(p), str(k)) for p, k in body["module_tree"])
        if _tree_hash(tree) != body["fingerprint"]:
            raise ValueError("module tree fingerprint")
        module_regions, regions = [], []
        for r in body["regions"]:
            m = ModuleRegion(
                path=str(r["module"]),
                kind=str(r["kind"]),
                depth=int(r["depth"]),
                keeps=tuple((str(op), int(k)) for op, k in r["keeps"]),
                ops=tuple(str(op) for op in r["ops"]),
                state_buffers=tuple(str(b) for b in r.get("state_buffers", ())),
            )
            module_regions.append(m)
            nodes, saved = tuple(map(str, r["nodes"])), tuple(map(str, r["saved_nodes"]))
            regions.append(Region(m.path, nodes, m.depth, m.kind, saved))
        pred = body["predictions"]
        shape = body.get("planned_shape")  # absent from files saved before it was recorded
        if shape is not None:
            shape = PlannedShape(
                shape=tuple(int(d) for d in shape["shape"]),
                predicted_peak_bytes=int(shape["predicted_peak_bytes"]),
                fixed_bytes=int(shape["fixed_bytes"]),
                attention_share=float(shape["attention_share"]),
            )
        return InplacePlan(
            solver=str(body["solver"]),
            regions=tuple(regions),
            module_regions=tuple(module_regions),
            budget_bytes=int(body["budget_bytes"]),
            predicted_peak_bytes=int(pred["peak_bytes"]),
            baseline_peak_bytes=int(pred["baseline_peak_bytes"]),
            predicted_recompute_flops=int(pred["recompute_flops"]),
            step_flops=int(pred["step_flops"]),
            model_class=str(body["model_class"]),
            module_tree=tree,
            parameter_shapes=tuple(
                (str(name), tuple(int(d) for d in shape))
                for name, shape in body.get("parameter_shapes", ())
            ),
            precision=str(body.get("precision", "")),
            planned_shape=shape,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFileError(
            f"{path} is missing or has a malformed field ({e!r}). Save the plan again with "
            f"plan.save(path)."
        ) from e


def apply_plan_file(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """``planner.apply_plan(model, path)``: check the file fits ``model``, then wrap in place."""
    plan = load_inplace(path)
    check_fits(
        model,
        plan.model_class,
        plan.module_tree,
        plan.module_regions,
        str(path),
        plan.parameter_shapes,
    )
    apply_regions(model, plan.module_regions, plan)
    install_guard(model, plan.planned_shape, plan.budget_bytes)
    return model
