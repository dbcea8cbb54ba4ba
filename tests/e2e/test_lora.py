"""LoRA through the CLI (docs/lora.md): the CPU demo learns with rank-8 adapters, and `megappo
export` writes merged weights, a peft adapter directory and the base model it applies to; the
commands of docs/lora.md's "Load the adapter with peft", taken from the page and run in a process
that cannot import megappo, load it with peft and give the same logits and greedy answers as the
merged export. The run syncs the engine with adapters only (rollout.lora_sync=adapters); the merged
sync is covered by tests/distributed/test_lora.py and the LoRA recipe case of tests/e2e/test_gpu_recipes.py."""

import json
import os
import re
import shlex
import sys

import torch

from tests import prefork
from tests.doc_console import check_quoted
from tests.e2e.test_cli_demo import REPO, cli

STEPS = 60
DOC = os.path.join(REPO, "docs", "lora.md")


def documented_peft_commands() -> tuple[list[str], list[str]]:
    """docs/lora.md's "Load the adapter with peft": (the bash block's lines, the python blocks)."""
    text = open(DOC).read()
    section = text.split("## Load the adapter with peft\n", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"```bash\n(.*?)```", section, re.S)
    python = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(bash) == 1 and len(python) == 2, "docs/lora.md's peft section: one bash block, two python blocks"
    return bash[0].strip().splitlines(), python


def test_the_documented_peft_install_is_the_tested_version():
    """The page's `pip install peft==V` names the version in constraints-tested.txt."""
    install = [line for line in documented_peft_commands()[0] if line.startswith("pip install")]
    tested = re.search(r"^peft==(\S+)$", open(os.path.join(REPO, "constraints-tested.txt")).read(), re.M)
    assert tested and install == [f"pip install peft=={tested.group(1)}"], (install, tested)


def test_demo_learns_with_lora_and_exports_a_peft_adapter(tmp_path):
    """The demo (random-init tiny Llama, PPO with a critic) with rank-8 adapters on all linears of the
    actor (its lm_head trained fully: a random-init model's frozen head caps its logits, docs/lora.md;
    lr 3e-3) and of the critic (its value head trains fully): the reward goes from ~0.03 to >= 0.35
    over steps 51-60 (measured 0.71 with the merged sync and 0.71 with adapters; 0.45 with a fully trained
    critic; full fine-tuning reaches 0.8). The run writes to runs/demo-lora (the page's run.output_dir) under tmp_path, where the
    documented commands then run."""
    run_dir = tmp_path / "runs" / "demo-lora"
    code, out = cli("train", "recipes/demo-cpu.yaml", f"run.output_dir={run_dir}", f"run.total_steps={STEPS}",
                    "actor.lora.rank=8", "actor.lora.modules_to_save=[lm_head]", "actor.optim.lr=3e-3",
                    "critic.lora.rank=8", "rollout.lora_sync=adapters",
                    "run.val_every=0", "run.val_before_train=false", "logging.progress_bar=false")
    assert code == 0, out[-6000:]
    assert "lora: actor r=8 alpha=16, critic r=8 alpha=16" in out, out[-3000:]
    check_quoted(out, __file__)  # docs/lora.md's start-up line (tests/doc_console.py)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "critic/score/mean" in r]
    first = sum(r["critic/score/mean"] for r in rows[:5]) / 5
    last = sum(r["critic/score/mean"] for r in rows[-10:]) / 10
    assert len(rows) == STEPS and first <= 0.2 and last >= 0.35, f"LoRA demo: {first:.2f} -> {last:.2f}"
    meta = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "actor" / "megappo_model.json").read_text())
    assert meta["lora"]["rank"] == 8 and meta["lora"]["modules_to_save"] == ["lm_head"]
    critic = json.loads((run_dir / "checkpoints" / f"step_{STEPS:08d}" / "critic" / "megappo_model.json").read_text())
    assert critic["lora"]["rank"] == 8 and critic["role"] == "critic"

    # the documented export, as the page writes it, from tmp_path (where runs/demo-lora is)
    bash, python = documented_peft_commands()
    exports = [shlex.split(line) for line in bash if line.startswith("megappo export")]
    assert len(exports) == 1, bash
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = prefork.run([sys.executable, "-m", "megappo.cli", *exports[0][1:]], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    out_dir = tmp_path / exports[0][-1]
    assert "peft adapter in" in proc.stdout and "docs/lora.md" in proc.stdout, proc.stdout
    adapter, base = out_dir / "adapter", out_dir / "base"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["modules_to_save"] == ["lm_head"]
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(base.resolve())

    # base/ is the model the run started from, bit for bit (its lm_head too, which the run trained)
    from safetensors.torch import load_file

    from megappo.models.hf_reference import build_hf_model
    from megappo.config import load_config

    recipe = load_config(os.path.join(REPO, "recipes", "demo-cpu.yaml"))
    start = build_hf_model(recipe.model.hf_config, seed=recipe.model.seed_init).state_dict()
    written = load_file(str(base / "model.safetensors"))
    assert sorted(written) == sorted(start)
    assert [n for n in start if not torch.equal(written[n], start[n])] == []

    # the documented python, in place, then (the second block) after moving the export elsewhere
    outputs = tmp_path / "peft_outputs.pt"
    script = "\n".join([
        "import sys", 'sys.modules["megappo"] = None  # the user has peft and transformers, not megappo',
        python[0], "in_place = model",
        "import os, shutil", 'os.makedirs("moved"); shutil.move("runs", "moved/runs"); os.chdir("moved")',
        python[1],
        "with torch.no_grad():",
        f"    torch.save({{'ids': ids, 'greedy': out, 'in_place': in_place(input_ids=ids).logits, "
        f"'moved': model(input_ids=ids).logits}}, {str(outputs)!r})"])
    env.pop("PYTHONPATH")
    proc = prefork.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = torch.load(outputs)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    moved = tmp_path / "moved" / exports[0][-1]
    merged = AutoModelForCausalLM.from_pretrained(str(moved), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(moved))
    ids = got["ids"]
    with torch.no_grad():
        logits = merged(input_ids=ids).logits
        greedy = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    for name in ("in_place", "moved"):
        diff = (got[name] - logits).abs().max().item()
        assert diff < 1e-5, f"peft ({name}) and the merged export differ by {diff:.2e}"
    assert torch.equal(got["greedy"], greedy)
    printed = proc.stdout.strip().splitlines()[-1]
    assert printed == str(tok.batch_decode(greedy[:, ids.shape[1]:], skip_special_tokens=True)), printed
