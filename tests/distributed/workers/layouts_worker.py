"""torchrun worker (2 ranks): several TP/PP layouts live side by side in one process.

usage: torchrun --nproc_per_node 2 layouts_worker.py

The default layout is TP=2; `add_layout` adds PP=2 and DP=2 over the same two ranks. Models
built in each layout are checked against transformers (logits, critic values) and trained
against a plain-torch AdamW reference, interleaving the layouts so that each one's Megatron
state (groups, schedules, DDP, optimizer) must be restored correctly every time. In each,
full tensors stream to several receiving ranks as to rank 0 (workers/receivers_check.py).
"""

import torch
import torch.distributed as dist

from megappo.parallel.state import add_layout, init_parallel
from model_worker import check_critic, check_lm
from receivers_check import check_receivers
from training_worker import check as check_training


def main():
    tp2 = init_parallel(2, 1)
    pp2 = add_layout(tp2, 1, 2)
    dp2 = add_layout(tp2, 1, 1)
    assert (pp2.tp, pp2.pp, pp2.dp) == (1, 2, 1) and (dp2.tp, dp2.pp, dp2.dp) == (1, 1, 2)
    input_ids = torch.randint(0, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(input_ids)
    attn[0, :3] = 0
    for ps in (pp2, tp2, dp2, pp2):
        check_lm(ps, "llama", input_ids, attn)
        check_critic(ps, "qwen2", input_ids)
    for ps, dist_opt in ((pp2, False), (dp2, True), (tp2, False)):
        check_training(ps, "llama", dist_opt)
    for ps in (tp2, pp2, dp2):
        check_receivers(ps, "llama")
    dist.barrier()
    if tp2.rank == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # without the interpreter's teardown (megappo.parallel.launch)
