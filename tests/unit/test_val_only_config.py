"""run.val_only's config (megappo.trainer.checkpointing.val_only_config): the checkpoint's saved settings for what the
model is and how it was trained, the command line's for validation, the machine, the run and logging."""

from megappo.trainer.checkpointing import VAL_ONLY_FROM_CHECKPOINT, val_only_config
from megappo.config import load_config

DEMO = "recipes/demo-cpu.yaml"


def test_training_settings_come_from_the_checkpoint_and_validation_keys_from_the_command_line():
    saved = load_config(DEMO, ["actor.optim.lr=5e-4", "rollout.val_n=1", "data.max_prompt_length=32"]).to_dict()
    given = load_config(DEMO, ["run.val_only=true", "algorithm.adv_estimator=grpo", "rollout.n=4", "rollout.val_n=3",
                               "rollout.val_temperature=0.7", "parallel.tp=1", "run.output_dir=elsewhere",
                               "reward.metric_functions=[digit_successor]", "logging.console=full"])
    cfg, unused = val_only_config(saved, given)
    # the checkpoint's: the algorithm, the sampling of training, the optimizer, the data's prompt length
    assert (cfg.algorithm.adv_estimator, cfg.rollout.n, cfg.actor.optim.lr, cfg.data.max_prompt_length) == \
        ("gae", 1, 5e-4, 32)
    # the command line's: validation sampling and scoring, the layout, the run's directory, logging
    assert (cfg.rollout.val_n, cfg.rollout.val_temperature, cfg.reward.metric_functions) == (3, 0.7, ["digit_successor"])
    assert (cfg.parallel.tp, cfg.run.output_dir, cfg.run.val_only, cfg.logging.console) == (1, "elsewhere", True, "full")
    assert sorted(unused) == ["actor.optim.lr=0.001 (the checkpoint's: 0.0005)",
                              'algorithm.adv_estimator="grpo" (the checkpoint\'s: "gae")',
                              "data.max_prompt_length=512 (the checkpoint's: 32)", "rollout.n=4 (the checkpoint's: 1)"]


def test_the_same_settings_name_nothing_and_give_the_checkpoints_config():
    saved = load_config(DEMO, []).to_dict()
    cfg, unused = val_only_config(saved, load_config(DEMO, ["run.val_only=true"]))
    assert unused == []
    assert {k: v for k, v in cfg.to_dict().items() if k in VAL_ONLY_FROM_CHECKPOINT} == \
        {k: v for k, v in saved.items() if k in VAL_ONLY_FROM_CHECKPOINT}
