"""Megatron-Core's import-time notes that Transformer Engine and apex are absent
(megappo.parallel.state._quiet_warnings): none on CPU, where their absence is by design; on a
GPU each text once, from rank 0 only, not once per importing module per rank."""

import uuid
import warnings

import pytest

from megappo.parallel.state import _quiet_warnings

TEXTS = ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
         "Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_applier",
         "Apex is not installed. Falling back to Torch Norm")


def _module_a(text):
    warnings.warn(text)


def _module_b(text):
    warnings.warn(text)


def shown(cpu: bool, rank: int) -> list[str]:
    tag = uuid.uuid4().hex  # the 'once' registry is per process: fresh texts for each call
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("default")  # python's own default: once per location
        _quiet_warnings(cpu=cpu, rank=rank)
        for text in TEXTS:
            for _ in range(2):
                _module_a(f"{text} {tag}")
                _module_b(f"{text} {tag}")  # the same text from another module, as megatron-core does
    return [str(w.message).removesuffix(f" {tag}") for w in seen]


@pytest.mark.parametrize("cpu,rank,expected", [(True, 0, []), (False, 1, []), (False, 0, list(TEXTS))])
def test_te_and_apex_notes_once_on_a_gpu_rank_0_and_never_on_cpu(cpu, rank, expected):
    assert shown(cpu, rank) == expected
