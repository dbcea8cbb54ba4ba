"""Every GPU recipe in recipes/, and every variant it lists, runs end to end on CPU at tiny size:
`megappo train` 2 steps (saved), `megappo export` of the actor (and the critic), the exports
loaded with transformers. One case (`STRAIGHT`) stops after step 1 and resumes: the resumed run
must equal the run that did not stop, bit for bit. (Resuming exactly at each layout, in bf16,
with the distributed optimizer, EP2 and LoRA, is tests/distributed/test_checkpoint.py's,
test_moe.py's and test_lora.py's; resuming a whole run, tests/e2e/test_resume.py's.)

Each case is the recipe file itself, through the CLI as a user runs it (`megappo train RECIPE
[--variant NAME] --world-size 2 KEY=VALUE ...`), with only these swaps (`SWAPS`, `two_ranks`):

| swapped | to | why |
|---|---|---|
| model.path | a tiny model of the recipe's family (`tiny_model`): the real model's model_type and architecture switches (tied embeddings, RoPE base and scaling, MoE routing, dense layers) with TINY_CONFIGS sizes (hidden 64, 2 layers; 4 under VPP2), bf16 safetensors, a byte-level tokenizer with a chat template, a few SFT steps so it answers in the reward's format | the real weights are 8B-72B |
| the layout | 2 gloo ranks (`two_ranks`): PP kept as PP2 (VPP kept), else EP kept as EP2, else TP2 or DP2, whichever the recipe has more of | 2 CPU ranks; each recipe keeps its kind of parallelism |
| rollout.replicas | 2 when the recipe has several (an hf engine on each rank), else 1 (`two_ranks`) | the recipes' replicas cover their GPUs (docs/gpu.md); at most one per rank |
| parallel.sequence_parallel | false | Megatron-Core's torch norms (the local layer spec, CPU) refuse it: it needs Transformer Engine or apex norms, i.e. a GPU |
| model.layer_spec | local | Transformer Engine is GPU-only |
| rollout.engine | hf | SGLang has its own lane (tests/sglang) |
| data.train_batch_size, ppo_mini_batch_size | 4 prompts, mini-batches of 2 | seconds, not hours; still 2 optimizer steps per PPO step |
| data.max_prompt_length, rollout.max_new_tokens | 160, 12 | the test prompts are up to 149 tokens, an answer ("\\boxed{7}") 10 |
| actor/critic.optim.lr | 1e-3 | at the recipes' 1e-6 no bf16 weight moves in 2 steps (an update is below half a bf16 ulp), so the test could not see training |
| logging.progress_bar, logging.samples | off, the whole batch | plain logs; every response's score kept to check it |
| reward.overlong_buffer.len, data.gen_batch_size | 4 of the 12 tokens, 2 x 4 prompts (recipes that set them: DAPO) | the recipe's buffer is longer than the swapped budget; DAPO's generation batch of 3 x the train batch is more than the 8 prompts of the tiny data |
| checkpoint.save_hf_at_end | true (the 2-step run) | the live model's export, compared with `megappo export` of the saved checkpoint |

Everything else is the recipe's: bf16, the algorithm and estimator, KL loss / KL in the reward
and its controller, rollout.n, packing with the micro-batch token budget (micro_batch_size x the
longest sequence), the distributed optimizer, the reward functions, validation before training,
logging sinks, the data keys (data/gsm8k/*.parquet, data/math/*.parquet: each run's working
directory links `data` to tests/data, tiny files in verl's layout written by
tests/data/make_recipe_data.py). No GPU recipe sets a per-role layout (`<role>.parallel`); a
recipe that does fails `test_every_gpu_recipe_and_variant_is_a_case` until `two_ranks` scales it.

Checked per case: the run ends well, with the checkpoint of step 2 (bf16); the metrics have
validation before training and steps 1 and 2; every response's
score is the recipe's reward function of it and the logged means are theirs; each export is
bf16, equal bit for bit to the trained model (`checkpoint.save_hf_at_end`), moved off the tiny
model it started from, and loads with transformers and its own tokenizer. `STRAIGHT` runs step 1,
then resumes for step 2 (announced), and also runs the 2 steps without stopping: the resumed run
must equal it bit for bit.

Variants that differ from another case only in hardware and layout become the same 2-rank run,
and so do the 4gpu variants, whose micro-batches of 1 with packing only change how the same
sequences are split into micro-batches. To keep CI under 50 minutes, some variants also run as a
case that differs in one thing another case runs (the model family at a layout, TP2 for DP2, GRPO
at PP2, recomputation on, KL in the reward): 9 runs for 8 recipes and 28 variants. `COLLAPSED`
writes down which runs as which and why, and a test checks that the resolved configs are equal
but for exactly the keys it names. What cannot run on CPU:
sequence parallelism (above; the value head under it: tests/distributed/test_value_head_sp.py),
Transformer Engine, SGLang; also TP > 1 for the MoE recipe, since Megatron trains MoE layers
under TP only with sequence parallelism (`two_ranks` gives it EP2 instead).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from megappo.config import load_config
from megappo.plan.planner import resolve_hf_config
from megappo.rewards import get_reward_fn
from tests import prefork
from tests.e2e._runs import hf_weights
from tests.e2e._runs import metrics as metrics_without_timings
from tests.e2e._tiny_models import tiny_config, tiny_instruct_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(REPO, "tests", "data")
GPU_RECIPES = sorted(p for p in glob.glob(os.path.join(REPO, "recipes", "*.yaml"))
                     if load_config(p).hardware.device == "gpu")

#: the swaps every case makes (the table in the module docstring says why)
SWAPS = ["model.layer_spec=local", "rollout.engine=hf", "parallel.sequence_parallel=false",
         "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
         "data.max_prompt_length=160", "rollout.max_new_tokens=12", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
         "logging.progress_bar=false", "logging.samples=64"]
#: the architecture switches of the real model that its tiny stand-in keeps (the sizes are TINY_CONFIGS')
ARCH_KEYS = ("architectures", "tie_word_embeddings", "rope_theta", "rope_scaling", "max_position_embeddings",
             "hidden_act", "attention_bias", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
#: what the tiny models answer, per reward function: the format it reads, (before, after) a digit
ANSWERS = {"gsm8k": ("#### ", ""), "math_boxed": ("\\boxed{", "}")}

#: variant -> (the case it runs as: "recipe.yaml:variant" or "recipe.yaml" (its own hardware), why, the keys
#: whose values may differ between the two 2-rank configs: none when the variant changes only hardware and
#: layout, micro_batch_size when it also sets micro-batches of 1, which with packing changes only how the
#: same sequences are split into micro-batches (the token budget); micro-batches of 1 run in the 8x48gb
#: cases)
RECOMPUTE = ("actor.recompute.granularity", "critic.recompute.granularity")
COLLAPSED = {
    "qwen2.5-7b-ppo-8gpu.yaml:4gpu": ("qwen3-8b-ppo-8gpu.yaml", "TP4 x DP1 instead of DP2: TP2, as the recipe; "
                                      "one engine instead of replicas, which every other case but the LoRA one runs",
                                      ("actor.micro_batch_size", "critic.micro_batch_size", "model.path",
                                       "rollout.replicas", "run.output_dir")),
    "qwen2.5-7b-ppo-8gpu.yaml:16gpu": ("qwen3-8b-ppo-8gpu.yaml", "TP4 x DP4 instead of DP2: TP2, as the recipe",
                                       ("model.path", "run.output_dir")),
    "qwen2.5-7b-ppo-8gpu.yaml:16x40gb": ("qwen2.5-7b-ppo-8gpu.yaml:8x48gb", "PP2 x DP2 instead of DP1: PP2", ()),
    "qwen3-8b-ppo-8gpu.yaml:16gpu": ("qwen3-8b-ppo-8gpu.yaml", "TP4 x DP4 instead of DP2: TP2", ()),
    # CI time: the rest collapse across a difference that another case runs
    "qwen2.5-7b-ppo-8gpu.yaml": ("qwen3-8b-ppo-8gpu.yaml", "the same PPO run at TP2 on Qwen3's stand-in; Qwen2.5's "
                                 "runs as itself at PP2 (8x48gb) and DP2 (h200)", ("model.path", "run.output_dir")),
    "qwen3-8b-ppo-8gpu.yaml:8x48gb": ("qwen2.5-7b-ppo-8gpu.yaml:8x48gb", "the same PPO run at PP2 on Qwen2.5's "
                                      "stand-in; Qwen3 runs as itself at TP2 here and at PP2 in "
                                      "tests/distributed/test_models.py", ("model.path", "run.output_dir")),
    "qwen3-8b-ppo-8gpu.yaml:16x40gb": ("qwen2.5-7b-ppo-8gpu.yaml:8x48gb", "as qwen3-8b:8x48gb",
                                       ("model.path", "run.output_dir")),
    "qwen3-8b-ppo-8gpu.yaml:h200": ("qwen2.5-7b-ppo-8gpu.yaml:h200", "the same PPO run at DP2 with the distributed "
                                    "optimizer on Qwen2.5's stand-in", ("model.path", "run.output_dir")),
    "llama3.1-8b-grpo-8gpu.yaml:8x40gb": ("llama3.1-8b-grpo-8gpu.yaml", "TP2 instead of DP2; TP2 runs in the PPO "
                                          "cases; one engine instead of replicas, as the LoRA case",
                                          ("parallel.tp", "rollout.replicas")),
    "llama3.1-8b-grpo-8gpu.yaml:4gpu": ("llama3.1-8b-grpo-8gpu.yaml", "TP2 x DP2: TP2, as 8x40gb",
                                        ("actor.micro_batch_size", "parallel.tp")),
    "llama3.1-8b-grpo-8gpu.yaml:16gpu": ("llama3.1-8b-grpo-8gpu.yaml", "TP2 x DP8 instead of DP4: DP2", ()),
    "llama3.1-8b-grpo-8gpu.yaml:h200": ("llama3.1-8b-grpo-8gpu.yaml", "TP1 x DP8 without SP: DP2", ()),
    "llama3.1-8b-grpo-8gpu.yaml:8x48gb": ("llama3.1-8b-grpo-8gpu.yaml", "TP8: TP2, as 8x40gb",
                                          ("parallel.tp", "rollout.replicas")),
    "qwen3-30b-a3b-grpo-32gpu.yaml:16gpu": ("qwen3-30b-a3b-grpo-32gpu.yaml", "EP8 over DP8 instead of DP16: EP2", ()),
    "qwen3-30b-a3b-grpo-32gpu.yaml:h200": ("qwen3-30b-a3b-grpo-32gpu.yaml", "EP4 instead of EP8: EP2", ()),
    "qwen2.5-72b-ppo-64gpu.yaml:128gpu": ("qwen2.5-72b-ppo-64gpu.yaml", "DP2 instead of DP1: PP2 x VPP2", ()),
    "qwen2.5-72b-ppo-64gpu.yaml:h200": ("qwen2.5-72b-ppo-64gpu.yaml", "PP4 instead of PP8: PP2 x VPP2", ()),
    "qwen2.5-72b-ppo-64gpu.yaml:grpo-32gpu": ("qwen2.5-72b-ppo-64gpu.yaml", "GRPO (n=8) instead of PPO; GRPO runs in "
                                              "the llama3.1 and qwen3-30b cases", ("algorithm.adv_estimator",
                                                                                   "rollout.n")),
    "qwen2.5-72b-ppo-64gpu.yaml:long-4k": ("qwen2.5-72b-ppo-64gpu.yaml", "full recomputation (the 4096-token budget is "
                                           "swapped anyway); it runs in llama3.3-70b:long-4k", RECOMPUTE),
    "llama3.3-70b-ppo-64gpu.yaml": ("llama3.3-70b-ppo-64gpu.yaml:long-4k", "the same without recomputation, which "
                                    "every other case runs", RECOMPUTE),
    "llama3.3-70b-ppo-64gpu.yaml:no-kl": ("llama3.3-70b-ppo-64gpu.yaml:long-4k", "no KL in the reward (the KL-free "
                                          "PPO path runs in qwen2.5-7b) and no recomputation",
                                          ("algorithm.kl_ctrl.type", "algorithm.use_kl_in_reward", *RECOMPUTE)),
    "llama3.3-70b-ppo-64gpu.yaml:128gpu": ("llama3.3-70b-ppo-64gpu.yaml:long-4k", "DP2 instead of DP1: PP2; without "
                                           "recomputation", RECOMPUTE),
    "llama3.3-70b-ppo-64gpu.yaml:h200": ("llama3.3-70b-ppo-64gpu.yaml:long-4k", "PP4 instead of PP8: PP2; without "
                                         "recomputation", RECOMPUTE),
    "qwen2.5-7b-dapo-8gpu.yaml:h200": ("qwen2.5-7b-dapo-8gpu.yaml", "TP2 x DP4 instead of TP4 x DP2: DP2 instead "
                                       "of TP2; DP2 runs in the llama3.1 case", ("parallel.tp",)),
    "llama3.3-70b-lora-grpo-8gpu.yaml:h200": ("llama3.3-70b-lora-grpo-8gpu.yaml", "a larger SGLang pool only", ()),
}
#: the case whose resumed run is also compared with a run straight through 2 steps (bf16, PPO, DP2 with
#: the distributed optimizer: sharded optimizer state in the checkpoint)
STRAIGHT = "qwen2.5-7b-ppo-8gpu.yaml:h200"


def case_name(recipe: str, variant: str | None) -> str:
    return os.path.basename(recipe) + (f":{variant}" if variant else "")


def two_ranks(cfg) -> list[str]:
    """The recipe's layout on 2 ranks: its pipeline as PP2 (with its VPP), else its expert
    parallelism as EP2 (DP2, TP1: MoE layers train under TP only with sequence parallelism),
    else TP2 or DP2, whichever of tp and dp the recipe has more of (TP on a tie); and its rollout
    replicas as one per rank when it has several."""
    p = cfg.parallel
    own = [role for role in ("actor", "critic", "ref", "reward") if getattr(cfg, role).parallel.tp or
           getattr(cfg, role).parallel.pp or getattr(cfg, role).parallel.ep]
    assert not own, f"{own} have their own layouts: scale them to 2 ranks in two_ranks"
    dp = cfg.hardware_world_size // (p.tp * p.pp)
    replicas = [f"rollout.replicas={min(2, cfg.rollout.replicas)}"]
    if p.pp > 1:
        return ["parallel.tp=1", "parallel.pp=2", "parallel.ep=1", *replicas]
    if p.ep > 1:
        return ["parallel.tp=1", "parallel.ep=2", *replicas]
    return ["parallel.tp=2" if p.tp >= dp else "parallel.tp=1", *replicas]


def tiny_model(cfg) -> tuple[str, int]:
    """(the tiny stand-in's directory name, its layers: 2, or one per virtual pipeline stage); the
    name says the real model, the layers and the reward whose format it answers in."""
    (reward,) = cfg.reward.functions
    layers = max(2, 2 * (cfg.parallel.vpp or 1))
    return f"{os.path.basename(cfg.model.path)}-tiny-{layers}l-{reward}", layers


def case_overrides(recipe: str, variant: str | None, models: str) -> list[str]:
    """Every override of a case: the swaps, the layout, model.path (`models`/`tiny_model`)."""
    cfg = load_config(recipe, variant=variant)
    return [*SWAPS, *dapo_swaps(cfg), *two_ranks(cfg), f"model.path={os.path.join(models, tiny_model(cfg)[0])}"]


#: DAPO's overlong buffer within the swapped budget of 12 tokens
OVERLONG_BUFFER = 4


def dapo_swaps(cfg) -> list[str]:
    """DAPO's keys at the swapped sizes: the overlong buffer, the generation batch (2 x 4 prompts: the tiny
    data has 8)."""
    out = [f"reward.overlong_buffer.len={OVERLONG_BUFFER}"] if cfg.reward.overlong_buffer.enable else []
    return out + ["data.gen_batch_size=8"] if cfg.data.gen_batch_size else out


def overlong(cfg, tokens: int) -> float:
    """The overlong penalty of a response of `tokens` tokens at the swapped sizes (verl's formula), 0 when off."""
    ob = cfg.reward.overlong_buffer
    return min(-(tokens - (cfg.rollout.max_new_tokens - ob.len)) / ob.len * ob.penalty_factor, 0) if ob.enable else 0.0


def resolved(recipe: str, variant: str | None, leave_out: tuple[str, ...] = ()) -> dict:
    """A case's config as the CPU run sees it, without the hardware it was sized for (and the
    variants, the SGLang settings), which change what fits on a GPU, not what runs here, and
    without the dotted keys `leave_out`."""
    cfg = load_config(recipe, case_overrides(recipe, variant, "MODELS"), variant).to_dict()
    for key in ("hardware", "variants", "rollout.sglang", *leave_out):
        *path, last = key.split(".")
        functools.reduce(dict.__getitem__, path, cfg).pop(last)
    return cfg


ALL = [(p, v) for p in GPU_RECIPES for v in [None, *load_config(p).variants]]
CASES = [(p, v) for p, v in ALL if case_name(p, v) not in COLLAPSED]


def test_every_gpu_recipe_and_variant_is_a_case():
    """Every GPU recipe and variant runs here, as itself or as the case it collapses to, whose
    2-rank config is the same but for the keys COLLAPSED names; no other variant collapses."""
    by_name = {case_name(p, v): (p, v) for p, v in ALL}
    assert len(GPU_RECIPES) >= 6 and set(COLLAPSED) <= set(by_name), sorted(set(COLLAPSED) - set(by_name))
    assert STRAIGHT in map(lambda c: case_name(*c), CASES)
    for name, (into, why, differs) in COLLAPSED.items():
        assert into in by_name and into not in COLLAPSED, (name, into)
        mine, theirs = resolved(*by_name[name], differs), resolved(*by_name[into], differs)
        assert mine == theirs, f"{name} is not the same run as {into} ({why})"
        assert all(resolved(*by_name[name], differs[:i] + differs[i + 1:]) != resolved(
            *by_name[into], differs[:i] + differs[i + 1:]) for i in range(len(differs))), f"{name}: {differs}"
    runs = [resolved(p, v) for p, v in CASES]
    for i, (p, v) in enumerate(CASES):
        same = [case_name(*CASES[j]) for j in range(i) if runs[j] == runs[i]]
        assert not same, f"{case_name(p, v)} is the same run as {same}: add it to COLLAPSED"


def test_shipped_data_is_what_its_script_writes():
    """tests/data/{gsm8k,math}/*.parquet hold the rows tests/data/make_recipe_data.py writes, in
    verl's layout, with the ground truth where the recipes' reward functions read it."""
    import importlib.util

    import pyarrow.parquet as pq

    spec = importlib.util.spec_from_file_location("make_recipe_data", os.path.join(DATA, "make_recipe_data.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name, row in (("gsm8k", script.gsm8k_row), ("math", script.math_row)):
        for split, sums in script.SUMS.items():
            shipped = pq.read_table(os.path.join(DATA, name, f"{split}.parquet")).to_pylist()
            assert shipped == [row(split, i, a, b) for i, (a, b) in enumerate(sums)], (name, split)
            assert all(r["reward_model"]["ground_truth"] == str(a + b) for r, (a, b) in zip(shipped, sums))


# -- the runs ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A directory of the tiny models, each built on first use (`tiny_model_dir`)."""
    return str(tmp_path_factory.mktemp("models"))


@functools.cache
def _rows(reward: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(DATA, {"gsm8k": "gsm8k", "math_boxed": "math"}[reward],
                                      "train.parquet")).to_pylist()


def tiny_model_dir(models: str, cfg) -> str:
    """Build the tiny stand-in of the recipe's model (`tiny_model`) in `models` unless it is there:
    the real model's model_type and ARCH_KEYS with TINY_CONFIGS' sizes, taught the reward's format."""
    name, layers = tiny_model(cfg)
    out = os.path.join(models, name)
    if not os.path.isdir(out):
        real, _ = resolve_hf_config(cfg.model.path, "model.path")
        hf_config = {**tiny_config(real["model_type"], layers),
                     **{k: real[k] for k in ARCH_KEYS if k in real}}
        (reward,) = cfg.reward.functions
        before, after = ANSWERS[reward]
        tiny_instruct_model(out, hf_config, _rows(reward), lambda d: f"{before}{d}{after}")
    return out


def cli(cwd: str, *args: str, timeout: int = 300) -> str:
    """`megappo ARGS` run in `cwd`; its output, or the test fails with it."""
    return clis(cwd, list(args), timeout=timeout)[0]


def clis(cwd: str, *commands: list[str], timeout: int = 300) -> list[str]:
    """Several `megappo` commands at once (each export is one process: both cores work)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    procs = [prefork.popen([sys.executable, "-m", "megappo.cli", *args], env=env, cwd=cwd, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for args in commands]
    outs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    for args, proc, out in zip(commands, procs, outs):
        assert proc.returncode == 0, f"megappo {' '.join(args)}\n{out[-6000:]}"
    return outs


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_export(out: str, live: str, init: str, role: str, lora: bool = False) -> None:
    """`megappo export`'s directory `out` is bf16 (config.json says so), holds the tensors of the
    live model's export `live` bit for bit, differs from the tiny model `init` it started from,
    and loads with transformers and its own tokenizer; a LoRA actor's (`lora`) adapter names `init` as its base."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    got, want, start = hf_weights(out), hf_weights(live), hf_weights(init)
    assert got.keys() == want.keys() and {t.dtype for t in got.values()} == {torch.bfloat16}
    unequal = [k for k in got if not torch.equal(got[k], want[k])]
    assert not unequal, f"{role}: the export of the checkpoint differs from the trained model in {unequal[:3]}"
    assert any(not torch.equal(got[k], start[k]) for k in got.keys() & start.keys()), f"{role}: no weight moved"
    for export in (out, live) if lora else ():  # the peft adapter names the run's model.path, copies nothing
        with open(os.path.join(export, "adapter", "adapter_config.json")) as f:
            assert json.load(f)["base_model_name_or_path"] == os.path.abspath(init)
        assert not os.path.exists(os.path.join(export, "base"))
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    if role == "actor":
        model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    else:
        model = AutoModelForTokenClassification.from_pretrained(out, num_labels=1, dtype="auto")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("recipe,variant", CASES, ids=[case_name(p, v) for p, v in CASES])
def test_recipe_runs_two_steps_and_exports(recipe, variant, models, tmp_path):
    times = {"start": time.time()}
    init = tiny_model_dir(models, load_config(recipe, variant=variant))
    overrides = case_overrides(recipe, variant, models)
    cfg = load_config(recipe, overrides, variant)  # the case as the run resolves it
    assert cfg.model.path == init and cfg.model.dtype == "bfloat16"
    os.symlink(DATA, tmp_path / "data")  # the recipe's data keys (data/gsm8k/train.parquet) as written
    train = ["train", recipe, *(["--variant", variant] if variant else []), "--world-size", "2", *overrides]
    run_dir = tmp_path / cfg.run.output_dir
    ckpts = run_dir / "checkpoints"
    trained = ("actor", "critic") if cfg.use_critic else ("actor",)
    times["model"] = time.time()

    straight = case_name(recipe, variant) == STRAIGHT
    if straight:  # stopped after step 1 and resumed
        # no validation after this leg's last step (as verl's, at the last step), which the straight run lacks
        cli(str(tmp_path), *train, "run.total_steps=1", "run.val_every=0")
        assert (ckpts / "latest").read_text() == "step_00000001"
        times["train 1 step"] = time.time()
    log = cli(str(tmp_path), *train, "run.total_steps=2", "checkpoint.save_hf_at_end=true")
    assert ("resumed from" in log and "(step 1)" in log) == straight, log[-3000:]
    assert (ckpts / "latest").read_text() == "step_00000002"
    for role in trained:
        with open(ckpts / "step_00000002" / role / "megappo_model.json") as f:
            assert json.load(f)["dtype"] == "bfloat16"
    times["resume, step 2" if straight else "train 2 steps"] = time.time()

    # the run: validation before training, 2 steps, every response scored by the recipe's reward
    metrics = rows(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "actor/pg_loss" in r] == [1, 2]
    assert metrics[0]["step"] == 0 and "val/score/mean" in metrics[0]
    samples = rows(run_dir / "samples.jsonl")
    assert len(samples) == 2 * cfg.data.train_batch_size * cfg.rollout.n
    (reward,) = cfg.reward.functions
    score = get_reward_fn(reward)
    for s in samples:
        want = score(s["response"], s["ground_truth"], {"finish_reason": s["finish_reason"]})
        assert s["score"] == want + overlong(cfg, s["response_tokens"]), s  # (multiples of 1/4: exact)
    for step in (1, 2):
        got = [s["score"] for s in samples if s["step"] == step]
        row = next(r for r in metrics if r["step"] == step and "critic/score/mean" in r)
        assert abs(row["critic/score/mean"] - sum(got) / len(got)) < 1e-6
    assert any(ANSWERS[reward][0] in s["response"] for s in samples), "no response in the reward's format"

    # the exports: bf16 HF directories equal to the trained model, which moved off its start
    clis(str(tmp_path), *(["export", str(run_dir), str(tmp_path / f"export-{role}"), "--role", role]
                          for role in trained))
    for role in trained:
        check_export(str(tmp_path / f"export-{role}"), str(run_dir / "hf" / role), init, role,
                     lora=role == "actor" and cfg.actor.lora.rank > 0)
    times["export"] = time.time()

    if straight:  # the resumed run is the run that did not stop, bit for bit
        cli(str(tmp_path), *train, "run.total_steps=2", "checkpoint.save_hf_at_end=true", "run.output_dir=straight")
        assert metrics_without_timings(str(run_dir)) == metrics_without_timings(str(tmp_path / "straight"))
        for role in trained:
            a, b = hf_weights(str(run_dir / "hf" / role)), hf_weights(str(tmp_path / "straight" / "hf" / role))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), role
        times["straight run"] = time.time()
    steps = list(times.items())
    print(f"\n{case_name(recipe, variant)}: {steps[-1][1] - steps[0][1]:.0f}s (" + ", ".join(
        f"{name} {t - before:.0f}s" for (_, before), (name, t) in zip(steps, steps[1:])) + ")")
