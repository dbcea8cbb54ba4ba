"""`<role>.dist_checkpoint` is checked before any rank starts (megappo.trainer.preflight.check_dist_checkpoints): a
directory with Megatron's metadata.json; the reference's is the actor's unless it names its own."""

import json
import pathlib

import pytest

from megappo.models.hf_config import ModelConfigError
from megappo.trainer.preflight import check_dist_checkpoints
from megappo.config import load_config

DEMO = str(pathlib.Path(__file__).resolve().parents[2] / "recipes/demo-cpu.yaml")


def test_a_dist_checkpoint_is_a_directory_with_megatrons_metadata(tmp_path):
    ckpt = tmp_path / "mcore"
    ckpt.mkdir()
    with pytest.raises(ModelConfigError, match=f"actor.dist_checkpoint={ckpt} is not a Megatron-Core dist checkpoint "
                                               r"\(no metadata.json in it\). Fix: point it at a directory written by "
                                               "dist_checkpointing.save"):
        check_dist_checkpoints(load_config(DEMO, [f"actor.dist_checkpoint={ckpt}"]))
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    check_dist_checkpoints(load_config(DEMO, [f"actor.dist_checkpoint={ckpt}", f"critic.dist_checkpoint={ckpt}"]))
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelConfigError, match=r"critic.dist_checkpoint=.*nowhere .*\(no such directory\)"):
        check_dist_checkpoints(load_config(DEMO, [f"critic.dist_checkpoint={missing}"]))
    # the reference's own, when the run has a reference
    with pytest.raises(ModelConfigError, match=r"ref.dist_checkpoint=.*nowhere .*\(no such directory\)"):
        check_dist_checkpoints(load_config(DEMO, [f"actor.dist_checkpoint={ckpt}", f"ref.dist_checkpoint={missing}",
                                                  "actor.use_kl_loss=true"]))
    check_dist_checkpoints(load_config(DEMO, [f"ref.dist_checkpoint={missing}"]))  # no reference in the demo
