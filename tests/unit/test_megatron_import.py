"""Megatron-Core's import-time torch.compile decorations are deferred to their first call
(megappo.megatron_import), and the `megappo` command ends its ranks without the interpreter's teardown."""

import importlib.metadata
import subprocess
import sys

import torch

from megappo.megatron_import import compile_deferred


def test_compile_is_deferred_to_the_first_call_with_the_same_arguments(monkeypatch):
    calls = []

    def real(model=None, **kwargs):
        calls.append((model, kwargs))
        return lambda *args: ("compiled", model(*args))

    monkeypatch.setattr(torch, "compile", real)
    module = torch.nn.Linear(2, 2)
    with compile_deferred():
        plus = torch.compile(lambda x: x + 1)
        twice = torch.compile(mode="max-autotune", dynamic=False)(lambda x: 2 * x)
        torch.compile(module)  # not a plain function: torch's compile, now
    assert torch.compile is real
    assert [c[0] for c in calls] == [module]
    assert plus(1) == ("compiled", 2) and plus(5) == ("compiled", 6)
    assert twice(3) == ("compiled", 6)
    assert len(calls) == 3  # each function compiled once, at its first call
    assert calls[2][1] == {"mode": "max-autotune", "dynamic": False}


def test_importing_megatron_core_after_megappo_imports_no_compiler():
    """In a fresh interpreter: `import megappo` then Megatron-Core's model and optimizer modules leave
    torch._dynamo unimported, torch.compile torch's own, and Megatron's fused functions deferred."""
    code = """
import sys, megappo, torch
real = torch.compile
import megatron.core.models.gpt, megatron.core.optimizer, megatron.core.dist_checkpointing
from megatron.core.fusions.fused_bias_swiglu import swiglu
assert 'megatron.core' in sys.modules
assert 'torch._dynamo' not in sys.modules and 'torch._inductor' not in sys.modules, 'a compiler was imported'
assert torch.compile is real
assert swiglu.__wrapped__.__name__ == 'swiglu' and swiglu.__code__ is not swiglu.__wrapped__.__code__
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]


def test_the_megappo_command_ends_ranks_through_exit_rank():
    """The installed `megappo` console script runs megappo.cli.entry (main, then exit_rank in a rank),
    not main alone: a rank of `megappo train` would otherwise spend seconds in the interpreter's teardown."""
    from megappo import cli

    scripts = {e.name: e for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["megappo"].load() is cli.entry
