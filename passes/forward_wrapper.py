"""The run-time stand-in for a module's ``forward``: what the eager pricing pass records module
calls with, and what ``planner/inplace.py`` runs an applied region with (checkpointing it)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch


class ForwardWrapper:
    """Stands in for one module's ``forward``: installed as ``MethodType(self, module)``, an
    instance attribute, so the class, ``state_dict()`` keys, parameters and hooks are untouched,
    ``inspect.signature(module.forward)`` is the original's (``__wrapped__``), and
    ``copy.deepcopy`` rebinds it to the copy. Subclasses define ``__call__(module, ...)``."""

    original: Callable[..., Any]
    had_own: bool  # the module already had an instance-level forward (another wrapper's)

    def install(self, module: torch.nn.Module) -> None:
        own = module.__dict__.get("forward")
        self.had_own = own is not None
        self.original = own if own is not None else type(module).forward
        # another wrapper's bound forward forwards __dict__ to that wrapper: merged in, its
        # ``original`` and ``had_own`` would replace ours (a region over an nn.Sequential
        # then skipped the forward that runs its runs, planner/inplace.py)
        chained = isinstance(getattr(own, "__func__", None), ForwardWrapper)
        functools.update_wrapper(
            self, self.original, updated=() if chained else functools.WRAPPER_UPDATES
        )
        module.forward = types.MethodType(self, module)

    def run_original(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.had_own:
            return self.original(*args, **kwargs)
        return self.original(module, *args, **kwargs)

    def uninstall(self, module: torch.nn.Module) -> None:
        if self.had_own:
            module.forward = self.original
        else:
            del module.forward
