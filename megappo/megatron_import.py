"""Importing Megatron-Core without paying for torch.compile at import time.

Megatron-Core decorates functions with `jit_fuser`, which is `torch.compile`, while its modules are
imported (fused bias-GeLU/SwiGLU/GeGLU, the MoE router's expert bias, L2 norm, ...). The first such
decoration imports torch._dynamo and torch._inductor: measured 1.8-2.0 s of the 4.5-5 s that
importing Megatron-Core takes on the 2-core CPU machine, in every rank of every launch (and every
distributed test worker), for functions megappo's models do not call (its configs turn the
fusions off). `install()` (run by megappo/__init__.py) adds an import hook: while the package
`megatron.core` is being imported (its `__init__` and everything that import pulls in),
`torch.compile(fn)` of a plain function returns `deferred(fn)`, which calls the real
`torch.compile(fn, same arguments)` at its first call and the compiled function from then on.
A function that is called is compiled exactly as before, at the same moment torch.compile would
have compiled it (torch.compile itself compiles lazily, at the first call); one that is never
called costs nothing. `torch.compile` of anything else (a module), and every call to it outside
that import, is torch's own (a call from another thread during that import is deferred too: the
same compile, later). The hook removes itself as soon as it has found `megatron.core`; when
Megatron-Core was imported before megappo, or is found by another finder, nothing is deferred.
During the same import, the optional packages Megatron-Core would import for code megappo never runs
(OPTIONAL_UNUSED: wandb) are hidden from it, as if not installed (megappo's own wandb sink imports wandb
itself).

This module does not know which Megatron functions are decorated or which of them a model calls.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys

PACKAGE = "megatron.core"


def deferred(real_compile, fn, **kwargs):
    """`fn`, compiled with `real_compile(fn, **kwargs)` at its first call."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kw):
        nonlocal compiled
        if compiled is None:
            compiled = real_compile(fn, **kwargs)
        return compiled(*args, **kw)

    return call


@contextlib.contextmanager
def compile_deferred():
    """While entered, `torch.compile` of a plain function (directly or as a decorator with arguments)
    returns `deferred`; anything else goes to torch's."""
    import torch

    real = torch.compile

    def stand_in(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=...): the decorator
            return lambda fn: stand_in(fn, **kwargs)
        if not inspect.isfunction(model):
            return real(model, **kwargs)
        return deferred(real, model, **kwargs)

    torch.compile = stand_in
    try:
        yield
    finally:
        torch.compile = real


class _Hook(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` with the standard path finder and runs its module under `compile_deferred`."""

    def find_spec(self, name, path, target=None):
        if name != PACKAGE:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # found some other way: the standard import, undeferred
        exec_module = spec.loader.exec_module

        def exec_deferred(module):
            with compile_deferred(), _without(OPTIONAL_UNUSED):
                exec_module(module)

        spec.loader.exec_module = exec_deferred  # this spec's own loader instance
        return spec


#: packages Megatron-Core imports when installed, for code megappo never runs (wandb: the dynamic inference
#: context's logging; about a second of every rank's start-up): hidden from it while it is imported
OPTIONAL_UNUSED = ("wandb",)


class _Hidden(importlib.abc.MetaPathFinder):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@contextlib.contextmanager
def _without(names):
    """While entered, importing one of `names` (not already imported) raises ModuleNotFoundError."""
    hidden = _Hidden([n for n in names if n not in sys.modules])
    sys.meta_path.insert(0, hidden)
    try:
        yield
    finally:
        sys.meta_path.remove(hidden)


_HOOK = _Hook()


def install() -> None:
    """Put the hook in place (once), unless megatron.core is already imported."""
    if PACKAGE not in sys.modules and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def uninstall() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
