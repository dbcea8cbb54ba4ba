"""GPU-only tests are marked `gpu` and skipped on machines without CUDA. tests/sglang (the
CPU SGLang lane, `make test-sglang`) runs in its own virtualenv and is left out elsewhere."""

import importlib.util

import pytest
import torch

collect_ignore = [] if importlib.util.find_spec("sglang") else ["sglang"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (megappo's CPU CI has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
