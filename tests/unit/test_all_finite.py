"""`all_finite` (the gradient check before an optimizer step) equals `isfinite(t).all()`."""

import pytest
import torch

from megappo.models.training import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_equals_isfinite_all(dtype):
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 16, 33, 1000, 100_003):
        base = torch.randn(n, generator=gen).to(dtype)
        assert bool(all_finite(base)) is True
        for value in (float("nan"), float("inf"), -float("inf")):
            for pos in {0, n // 2, n - 1}:
                t = base.clone()
                t[pos] = value
                assert bool(all_finite(t)) is bool(torch.isfinite(t).all()) is False, (n, value, pos)
    assert bool(all_finite(torch.empty(0, dtype=dtype))) is True
    assert bool(all_finite(torch.full((5,), torch.finfo(dtype).max, dtype=dtype))) is True
