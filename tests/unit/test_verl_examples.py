"""tools/verl_examples.py: a verl example script's `main_ppo` command line, found and expanded as bash would
(continuations, variables with defaults, arrays, arithmetic, quoting, redirections), and read by megappo. CI
has no verl checkout, so the scripts here are small inline samples written the ways verl's are."""

import importlib.util
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("verl_examples", REPO / "tools/verl_examples.py")
verl_examples = importlib.util.module_from_spec(_spec)
sys.modules["verl_examples"] = verl_examples  # its dataclass looks its module up
_spec.loader.exec_module(verl_examples)

#: verl's older style: variables, backslash continuations, a redirection, Hydra's flags
OLD_STYLE = r"""#!/bin/bash
set -x
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-3B}   # a default the environment may replace
max_prompt_length=$((1024 * 2))
max_response_length=$(((max_prompt_length + 1024) / 2))
gsm8k_train=$HOME/data/gsm8k/train.parquet
train_files="['$gsm8k_train']"
ACTOR_CONFIG="actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=8"
python3 -m verl.trainer.main_ppo \
    --config-path=./config --config-name ppo_trainer \
    algorithm.adv_estimator=grpo \
    data.train_files="$train_files" \
    data.max_prompt_length=$max_prompt_length \
    data.max_response_length=${max_response_length} \
    $ACTOR_CONFIG \
    actor_rollout_ref.model.path="$MODEL_PATH" \
    trainer.logger='["console","wandb"]' \
    trainer.default_local_dir=$CKPTS_DIR \
    # a comment line inside the command ends it in bash too
    trainer.total_epochs=15 $@ 2>&1 | tee log.txt
echo done
"""

#: verl's current style: parameter arrays, an `if` that changes one, the launcher in an array
NEW_STYLE = r"""#!/usr/bin/env bash
INFER_BACKEND=${INFER_BACKEND:-vllm}
rollout_n=${ROLLOUT_N:-5}
DATA=(
    algorithm.adv_estimator=grpo
    data.train_batch_size=${TRAIN_BATCH_SIZE:-1024}   # inline comment
    actor_rollout_ref.model.path="${MODEL_PATH:-Qwen/Qwen3-8B}"
)
ROLLOUT=(
    actor_rollout_ref.rollout.name=${INFER_BACKEND}
    actor_rollout_ref.rollout.n=${rollout_n}
)
ROLLOUT+=(actor_rollout_ref.rollout.ignore_eos=False)
LAUNCH=(python3)
RAY=(ray_kwargs.ray_init.runtime_env.py_executable=null)
if [ "${VERL_USE_UV:-1}" != 0 ]; then
    RAY=(ray_kwargs.ray_init.runtime_env.py_executable="uv -v run --extra ${INFER_BACKEND}")
fi
cat <<EOF > notes.txt
python3 -m verl.trainer.main_ppo not.a=command
EOF
"${LAUNCH[@]}" -m verl.trainer.main_ppo \
    "${DATA[@]}" \
    "${ROLLOUT[@]}" \
    model_engine=megatron \
    "${RAY[@]}" \
    "$@"
"""


def test_an_older_scripts_command_line_is_expanded_as_bash_would():
    (line,) = verl_examples.command_lines(OLD_STYLE, "old.sh")
    assert verl_examples.overrides(line.words) == [
        "algorithm.adv_estimator=grpo",
        "data.train_files=['/home/user/data/gsm8k/train.parquet']",
        "data.max_prompt_length=2048",
        "data.max_response_length=1536",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B",
        'trainer.logger=["console","wandb"]',
        "trainer.default_local_dir=",
    ]
    assert line.words[:3] == ["--config-path=./config", "--config-name", "ppo_trainer"]
    assert verl_examples.hydra_flags(line.words) == ("./config", "ppo_trainer")
    assert line.unset == ["CKPTS_DIR"]  # MODEL_PATH has its default


def test_a_current_scripts_arrays_are_expanded_item_by_item():
    (line,) = verl_examples.command_lines(NEW_STYLE, "new.sh")  # the here-document is not a command
    assert line.words == [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.rollout.ignore_eos=False", "model_engine=megatron",
        "ray_kwargs.ray_init.runtime_env.py_executable=uv -v run --extra vllm",
    ]


def test_the_tool_counts_read_and_refused_lines_of_a_checkout(tmp_path, capsys):
    """The tool over a small checkout (a git repository, read at a revision): one line read (on verl's defaults,
    which its --config-name names), one refused with the feature it needs, one script that starts another entry
    not counted."""
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "run_new.sh").write_text(NEW_STYLE.replace(  # on verl's defaults, as megappo train reads it
        '"${DATA[@]}"', '--config-path=config --config-name=ppo_megatron_trainer "${DATA[@]}"'))
    (examples / "run_r2.sh").write_text(NEW_STYLE.replace(
        "model_engine=megatron", "model_engine=megatron actor_rollout_ref.actor.router_replay.mode=R2"))
    (examples / "run_sft.sh").write_text("torchrun -m verl.trainer.sft_trainer data.train_batch_size=4\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "examples"], check=True)
    for rev in (None, "HEAD"):
        assert verl_examples.main([str(tmp_path), *(["--rev", rev] if rev else []), "--keys"]) == 0
        out = capsys.readouterr().out
        assert "2 main_ppo command lines in 2 scripts; 1 read as written, 1 refused (1 on the recipe their " \
               "--config-name names" in out.splitlines()[0]
        assert "\nexamples/run_r2.sh\n    'actor_rollout_ref.actor.router_replay.mode=R2' is a verl key " \
               "megappo does not read as written. Fix: " in out
        assert "    2 unused    model_engine" in out and "    1 refused   actor_rollout_ref.actor.router_replay." \
               "mode" in out
