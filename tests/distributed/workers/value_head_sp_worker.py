"""torchrun worker (2 ranks, gloo): the critic's value head under sequence parallelism.

With parallel.sequence_parallel the final norm's output reaches the value head split along the
sequence over the TP ranks ([S/tp, B, H]). Every rank holds its slice of the same full hidden
states [S, B, H]; the head with sequence_parallel=True must give the full [S, B, 1] values of
the head without it on the whole tensor, bit for bit, on every rank, and the gradients of a
weighted sum of them: the rank's slice of the full input gradient and the full weight and bias
gradients (a reduce-scatter in the backward would double them at TP2).
"""

import torch

from megappo.models.builders import ValueHead
from megappo.parallel.state import destroy_parallel, init_parallel

S, B, H = 8, 3, 16


def main():
    ps = init_parallel(tp=2, pp=1)
    from megatron.core import parallel_state as mps

    gen = torch.Generator().manual_seed(0)
    full = torch.randn(S, B, H, generator=gen)
    weights = torch.randn(S, B, 1, generator=gen)  # d(loss)/d(values): the same on every rank

    ref = ValueHead(H, bias=True, init_std=0.5, dtype=torch.float32, seed=3)
    x_ref = full.clone().requires_grad_()
    values_ref = ref(x_ref)[0]
    (values_ref * weights).sum().backward()

    head = ValueHead(H, bias=True, init_std=0.5, dtype=torch.float32, seed=3, sequence_parallel=True,
                     tp_group=mps.get_tensor_model_parallel_group())
    x = full.chunk(ps.tp)[ps.tp_rank].clone().requires_grad_()  # this rank's [S/tp, B, H]
    values = head(x)[0]
    (values * weights).sum().backward()

    assert values.shape == (S, B, 1) and torch.equal(values, values_ref), (values - values_ref).abs().max()
    assert torch.equal(x.grad, x_ref.grad.chunk(ps.tp)[ps.tp_rank]), (x.grad, x_ref.grad)
    assert torch.equal(head.weight.grad, ref.weight.grad) and torch.equal(head.bias.grad, ref.bias.grad)
    print(f"OK rank {ps.rank}", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
