"""A Megatron dist checkpoint written the way verl's scripts/converter_hf_to_mcore.py writes one: megappo's
GPTModel at TP=1 (a world of one) with an HF directory's weights, saved with
`dist_checkpointing.save(model.sharded_state_dict(), OUT)`: no megappo metadata, no nesting.

    python tests/e2e/_verl_dist_checkpoint.py save HF_DIR OUT
    python tests/e2e/_verl_dist_checkpoint.py load HF_DIR CKPT ROLE   # load_dist_weights; prints its error
"""

import os
import sys

from megatron.core import dist_checkpointing

from megappo.models.builders import build_model, unwrap
from megappo.models.checkpoint import load_dist_weights
from megappo.models.hf_config import ModelConfigError, dims_from_hf, load_hf_config
from megappo.models.weights import load_hf_weights
from megappo.parallel.state import destroy_parallel, init_parallel


def main(mode: str, hf_dir: str, path: str, role: str = "actor") -> int:
    ps = init_parallel(1, 1)
    model = build_model(dims_from_hf(load_hf_config(hf_dir)), ps, role=role)
    if mode == "save":
        load_hf_weights(model, hf_dir)
        os.makedirs(path)
        dist_checkpointing.save(unwrap(model.chunks[0]).sharded_state_dict(), path)
    else:
        try:
            load_dist_weights(model, path, named_by=f"{role}.dist_checkpoint")
            print("loaded")
        except ModelConfigError as e:
            print(f"error: {e}")
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
