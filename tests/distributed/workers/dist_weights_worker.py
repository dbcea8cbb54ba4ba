"""torchrun worker (2 ranks): a role's starting weights from a Megatron dist checkpoint at another layout.

usage: torchrun --nproc_per_node 2 dist_weights_worker.py OUT_DIR

For tiny Llama (untied) and Qwen2 (tied embeddings): a model at TP=2 with an HF model's weights is saved the
way verl's converter saves one (`dist_checkpointing.save(gpt_model.sharded_state_dict(), DIR)`: no megappo
metadata). At PP=2, PP=2 x VPP=2 and DP=2 (TP=1), `load_dist_weights` gives the actor every full tensor equal
bit for bit to the same layout's model loaded from the HF weights (`load_hf_weights`), and the critic its trunk
(its value head stays its own init).
"""

import os
import sys

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megappo.models.builders import build_model, unwrap
from megappo.models.checkpoint import load_dist_weights
from megappo.models.hf_config import dims_from_hf
from megappo.models.hf_experts import checkpoint_state
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model
from megappo.models.weights import iter_full_params, load_hf_weights
from megappo.parallel.state import add_layout, init_parallel


def main(out_dir: str) -> None:
    ps = init_parallel(2, 1)
    layouts = {"pp2": add_layout(ps, 1, 2), "pp2xvpp2": add_layout(ps, 1, 2, 2), "dp2": add_layout(ps, 1, 1)}
    for family in ("llama", "qwen2"):
        dims = dims_from_hf(TINY_CONFIGS[family])
        hf = checkpoint_state(build_hf_model(TINY_CONFIGS[family], seed=3))
        saver = build_model(dims, ps, role="actor")
        load_hf_weights(saver, hf)
        path = os.path.join(out_dir, family)
        if dist.get_rank() == 0:
            os.makedirs(path)
        dist.barrier()
        with ps.active():
            dist_checkpointing.save(unwrap(saver.chunks[0]).sharded_state_dict(), path)
        for name, layout in layouts.items():
            for role in ("actor", "critic"):
                loaded, reference = build_model(dims, layout, role=role), build_model(dims, layout, role=role)
                load_dist_weights(loaded, path, named_by=f"{role}.dist_checkpoint")
                load_hf_weights(reference, hf)
                got, want = dict(iter_full_params(loaded)), dict(iter_full_params(reference))
                if dist.get_rank() == 0:
                    trunk = [k for k in want if not k.startswith("output_layer")] if role == "critic" else list(want)
                    assert got.keys() == want.keys() and len(trunk) > 5, (got.keys(), want.keys())
                    bad = [k for k in trunk if not torch.equal(got[k], want[k])]
                    assert not bad, (family, name, role, bad)
                    print(f"OK {family} {name} {role}", flush=True)
    if dist.get_rank() == 0:
        print("ALL OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
