"""Hugging Face's own activation checkpointing beside a planner plan, and what says a plan is on.

transformers checkpoints layers itself when their flags say so: every module with a
``gradient_checkpointing`` attribute set True (each ``GradientCheckpointingLayer``; before 5.x
also some ``*Model`` classes) runs its forward under ``torch.utils.checkpoint``.
``model.gradient_checkpointing_enable()`` (5.x: ``activation_checkpointing_enable()``, which
``TrainingArguments(gradient_checkpointing=True)`` calls) sets them, and
``model.is_gradient_checkpointing`` (5.x: ``is_activation_checkpointing``) reports any of them.
Left on beside a plan, every layer would recompute on top of the plan's regions, silently. So:

- **planning** (:func:`paused`): flags found on are turned off while the step is priced, then
  put back, with a warning saying how to apply the plan (priced with them on, the layers are
  already checkpoints and the plan came back with no region and no word why);
- **applying** (:func:`mark_applied`): flags found on are turned off, with a warning (the plan
  replaces them); every Hugging Face model in the tree then gets guards over its
  enable/disable methods (instance attributes, as ``ForwardWrapper`` installs ``forward``) and,
  where it has no ``gradient_checkpointing`` attribute of its own (so no transformers code reads
  one there), one set True, so that ``is_gradient_checkpointing`` says True;
- **enabling** Hugging Face's checkpointing while the plan is applied raises
  ``CheckpointingConflictError``; **disabling** it suspends the plan (the model then runs
  without checkpointing and says so), and enabling it again restores the plan instead of
  Hugging Face's: trl toggles the flags this way around generation;
- ``planner.remove(model)`` undoes all of it, the flags that applying turned off turned on
  again (unless Hugging Face's disable was called meanwhile: then they stay off, as asked);
  :func:`applied_plan` returns the applied plan.

Nothing here imports transformers: its models are recognised by their methods.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.solvers.errors import CheckpointingConflictError

_STATE = "_planner_applied"  # the attribute on the model a plan was applied to
_ENABLE = ("gradient_checkpointing_enable", "activation_checkpointing_enable")
_DISABLE = ("gradient_checkpointing_disable", "activation_checkpointing_disable")
# set beside a ``gradient_checkpointing`` attribute that is this file's marker, not Hugging
# Face's flag (an attribute, not a registry, so that copy.deepcopy keeps it)
_MARKER = "_planner_gc_marker"


@dataclass
class _Applied:
    """What ``mark_applied`` put on the model, so that ``unmark`` can take it back."""

    plan: Any  # the in-place Plan (None when only regions were applied)
    regions: tuple[Any, ...]  # its regions, to re-wrap after a suspension
    # inplace.wrap_regions / unwrap_regions, handed in so that this module needs no import
    # of the module that imports it
    wrap: Callable[[torch.nn.Module, tuple[Any, ...]], None]
    unwrap: Callable[[torch.nn.Module], None]
    suspended: bool = False
    guarded: list[tuple[torch.nn.Module, str]] = field(default_factory=list)
    # the Hugging Face flags applying found on and turned off: ``remove`` turns them on again
    turned_off: list[str] = field(default_factory=list)


def is_hf_model(module: torch.nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by its methods, without importing transformers)."""
    cls = type(module)
    return hasattr(cls, "gradient_checkpointing_enable") and hasattr(
        cls, "supports_gradient_checkpointing"
    )


def hf_flags_on(model: torch.nn.Module) -> list[str]:
    """Paths of the modules whose Hugging Face checkpointing flag is on (markers excluded)."""
    return [
        path
        for path, m in model.named_modules()
        if _MARKER not in m.__dict__ and getattr(m, "gradient_checkpointing", False) is True
    ]


def turn_off(model: torch.nn.Module) -> list[str]:
    """Turn Hugging Face's checkpointing flags off; the paths of those that were on."""
    paths = hf_flags_on(model)
    _turn_off(model, paths)
    return paths


def _turn_off(model: torch.nn.Module, paths: list[str]) -> None:
    for path in paths:
        # an instance attribute: GradientCheckpointingLayer's class default is False
        model.get_submodule(path).gradient_checkpointing = False


@contextmanager
def paused(model: torch.nn.Module) -> Iterator[None]:
    """Price ``model`` as it runs without Hugging Face's checkpointing; its flags are put back
    afterwards. Warns when any was on."""
    paths = hf_flags_on(model)
    if paths:
        warnings.warn(
            f"planner: {type(model).__name__} has Hugging Face gradient checkpointing on "
            f"({len(paths)} modules, e.g. {paths[0]!r}); planned as if it were off, since the "
            f"plan replaces it. p.apply(model) turns it off (a graph plan's p.module runs "
            f"without it); do not enable it again (TrainingArguments("
            f"gradient_checkpointing=False)).",
            stacklevel=3,
        )
    _turn_off(model, paths)
    try:
        yield
    finally:
        for path in paths:
            model.get_submodule(path).gradient_checkpointing = True


def mark_applied(
    model: torch.nn.Module,
    plan: Any,
    regions: tuple[Any, ...],
    wrap: Callable[[torch.nn.Module, tuple[Any, ...]], None],
    unwrap: Callable[[torch.nn.Module], None],
) -> None:
    """After wrapping ``model``'s regions: turn Hugging Face's flags off (warning), guard its
    enable/disable methods, set the markers and record ``plan`` on ``model``. ``wrap`` and
    ``unwrap`` put the regions back on and take them off again around a suspension."""
    paths = hf_flags_on(model)
    if paths:
        warnings.warn(
            f"planner: turned off Hugging Face gradient checkpointing on {type(model).__name__} "
            f"({len(paths)} modules, e.g. {paths[0]!r}): the applied plan checkpoints instead; "
            f"planner.remove(model) turns it back on.",
            stacklevel=4,
        )
        _turn_off(model, paths)
    state = _Applied(plan, tuple(regions), wrap, unwrap, turned_off=paths)
    for m in model.modules():
        if not is_hf_model(m):
            continue
        for name in (*_ENABLE, *_DISABLE):
            if hasattr(type(m), name) and name not in m.__dict__:
                m.__dict__[name] = types.MethodType(_Guard(model, name), m)
                state.guarded.append((m, name))
    model.__dict__[_STATE] = state
    _set_markers(model, True)


def _set_markers(model: torch.nn.Module, on: bool) -> None:
    for m in model.modules():
        if on and is_hf_model(m) and not hasattr(m, "gradient_checkpointing"):
            m.__dict__["gradient_checkpointing"] = True
            m.__dict__[_MARKER] = True
        elif not on and m.__dict__.pop(_MARKER, False):
            m.__dict__.pop("gradient_checkpointing", None)


def unmark(model: torch.nn.Module) -> None:
    """Take back what :func:`mark_applied` put on ``model`` (nothing if it put nothing)."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return
    for m, name in state.guarded:
        m.__dict__.pop(name, None)
    _set_markers(model, False)
    if not state.suspended:  # a disable() meanwhile turned Hugging Face's off for good
        for path in state.turned_off:
            model.get_submodule(path).gradient_checkpointing = True


def applied_plan(model: torch.nn.Module) -> Any:
    """The plan applied to ``model`` in place (``p.apply(model)``, ``planner.apply_plan``), or
    None: none applied, removed, or suspended by ``gradient_checkpointing_disable()``."""
    state = model.__dict__.get(_STATE)
    return None if state is None or state.suspended else state.plan


class _Guard:
    """Stands in for one Hugging Face enable/disable method of a model under a plan."""

    def __init__(self, root: torch.nn.Module, name: str) -> None:
        self.root, self.name = root, name

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        state: _Applied | None = self.root.__dict__.get(_STATE)
        if state is None:  # a stale guard (the root's plan was removed some other way)
            return getattr(type(module), self.name)(module, *args, **kwargs)
        if self.name in _ENABLE:
            if not state.suspended:
                raise CheckpointingConflictError(
                    f"{self.name}() on {type(module).__name__}, which a planner plan already "
                    f"checkpoints: Hugging Face's checkpointing would recompute every layer on "
                    f"top of the plan. Keep the plan and leave Hugging Face's off "
                    f"(TrainingArguments(gradient_checkpointing=False)), or call "
                    f"planner.remove(model) first to use Hugging Face's instead."
                )
            state.wrap(self.root, state.regions)
            state.suspended = False
            _set_markers(self.root, True)
            return None
        if not state.suspended:
            warnings.warn(
                f"planner: {self.name}() suspended the applied plan on "
                f"{type(self.root).__name__}: it trains without checkpointing until "
                f"gradient_checkpointing_enable() restores the plan (not Hugging Face's "
                f"checkpointing); planner.remove(model) drops it.",
                stacklevel=2,
            )
            state.unwrap(self.root)
            state.suspended = True
            _set_markers(self.root, False)
        # Hugging Face's own disable too (its flags are already off; it may undo PEFT's input
        # hooks); its checks of whether the method is overridden reach this guard again
        return getattr(type(module), self.name)(module, *args, **kwargs)
