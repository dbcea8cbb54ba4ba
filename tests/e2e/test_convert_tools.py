"""tools/convert_*.py end to end: TP2xPP2 round trips with --verify, every registered family as
the installed transformers saves it, and bad input.

Each tool launches its own ranks (tp*pp), as a user would run it.
"""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megappo.models.hf_config import SUPPORTED_ARCHS
from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model, save_hf_dir, save_pretrained
from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tool(name, *args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = prefork.run([sys.executable, os.path.join(REPO, "tools", name), *args], env=env,
                       capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(out[-6000:])
    return proc.returncode, out


def make_hf_dir(path, family, seed=1):
    model = build_hf_model(TINY_CONFIGS[family], seed=seed)
    state = {k: v for k, v in model.state_dict().items()
             if not (TINY_CONFIGS[family]["tie_word_embeddings"] and k == "lm_head.weight")}
    save_hf_dir(str(path), state, TINY_CONFIGS[family], max_shard_bytes=200_000)  # several shards
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return state


# Qwen3's q/k norms go through the tools in the Qwen3-MoE round trip below (the same attention);
# a dense Qwen3 round trip here cost CI 45 s for no other path.
@pytest.mark.parametrize("family", ["llama"])  # CI time: qwen2's names (biases) go through the same tools; its name
def test_round_trip_tp2xpp2_with_verify(tmp_path, family):  # map is tested in tests/distributed/test_bridge.py
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    state = make_hf_dir(hf_dir, family)
    _, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--out", str(ckpt),
                      "--tp", "2", "--pp", "2", "--verify")
    verify = json.loads(out.split("verify: ")[1].splitlines()[0])
    assert verify["tensors_bit_exact"] == len(state) and verify["max_abs_logit_diff"] <= 1e-4
    assert (ckpt / "megappo_model.json").is_file() and (ckpt / "hf" / "tokenizer_config.json").is_file()
    _, out = run_tool("convert_megatron_to_hf.py", "--ckpt", str(ckpt), "--out", str(back),
                      "--tp", "2", "--pp", "2", "--verify")
    assert '"max_abs_logit_diff"' in out
    written = {}
    for f in back.glob("*.safetensors"):
        written.update(load_file(str(f)))
    assert set(written) == set(state)
    assert all(torch.equal(written[k], state[k]) for k in state)
    assert json.loads((back / "config.json").read_text()) == TINY_CONFIGS[family]
    assert (back / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob("*.tmp-*"))
    # every rank recorded the digests of the files it wrote; a damaged shard is named before any rank starts
    assert sorted(p.name for p in (ckpt / "digests").iterdir()) == [f"rank_0000{r}.json" for r in range(4)]
    shard = ckpt / "__3_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out = run_tool("convert_megatron_to_hf.py", "--ckpt", str(ckpt), "--out", str(tmp_path / "again"),
                         check=False)
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert f"model checkpoint {ckpt} is damaged: {shard}: its bytes differ" in out and "convert it again" in out, out
    assert not (tmp_path / "again").exists()


def test_every_family_saved_by_transformers_converts_with_verify(tmp_path):
    """Each registered family as the installed transformers writes it (its own config class and
    save_pretrained: the key names of that release, e.g. Qwen3-MoE's num_local_experts in 5.24)
    converts with logits equal to transformers'. Qwen3-MoE goes through the tool at EP2 in the
    test below; the others in one process at TP1 (tests/e2e/_convert_in_process.py)."""
    families = [f for f in SUPPORTED_ARCHS.values() if f != "qwen3_moe"]
    args, sizes = [], {}
    for family in families:
        sizes[str(tmp_path / family)] = len(save_pretrained(str(tmp_path / family), TINY_CONFIGS[family], seed=1))
        args += [str(tmp_path / family), str(tmp_path / f"{family}-mcore")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("WORLD_SIZE", None)
    proc = prefork.run([sys.executable, os.path.join(REPO, "tests", "e2e", "_convert_in_process.py"), *args],
                       env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    results = [json.loads(line[len("verify: "):]) for line in proc.stdout.splitlines() if line.startswith("verify: ")]
    assert [r["hf_dir"] for r in results] == list(sizes)
    for r in results:
        assert r["tensors_bit_exact"] == sizes[r["hf_dir"]] and r["max_abs_logit_diff"] <= 1e-4, r


def test_moe_round_trip_at_ep2_with_verify(tmp_path):
    # Qwen3-MoE saved by transformers (save_pretrained: per-expert checkpoint names, the expert count
    # under the name the installed release writes); EP=2 (each rank reads only its own experts), back at PP=2
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    state = save_pretrained(str(hf_dir), TINY_CONFIGS["qwen3_moe"], seed=1)
    _, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--out", str(ckpt), "--ep", "2", "--verify")
    verify = json.loads(out.split("verify: ")[1].splitlines()[0])
    assert verify["tensors_bit_exact"] == len(state) and verify["max_abs_logit_diff"] <= 1e-4
    _, out = run_tool("convert_megatron_to_hf.py", "--ckpt", str(ckpt), "--out", str(back), "--pp", "2", "--verify")
    written = {}
    for f in back.glob("*.safetensors"):
        written.update(load_file(str(f)))
    assert set(written) == set(state) and all(torch.equal(written[k], state[k]) for k in state)
    code, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o"),
                         "--ep", "3", check=False)
    assert code != 0 and "num_experts=4 is not divisible by --ep=3. Fix: choose --ep from [1, 2, 4]" in out


@pytest.mark.one_process  # no rank starts (tests/conftest.py)
def test_bad_layout_stops_before_any_rank_starts(tmp_path):
    make_hf_dir(tmp_path / "hf", "llama")
    code, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(tmp_path / "hf"), "--out",
                         str(tmp_path / "o"), "--tp", "4", check=False)
    assert code != 0 and "num_key_value_heads=2 is not divisible by tp=4" in out and "Fix:" in out
    assert not (tmp_path / "o").exists()


def test_missing_weight_file_and_unknown_arch(tmp_path):
    hf = tmp_path / "hf"
    make_hf_dir(hf, "llama")
    next(hf.glob("model-00002-*.safetensors")).unlink()
    code, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(tmp_path / "o"), check=False)
    assert code != 0 and "names weight files that are missing" in out
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    code, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(tmp_path / "o"), check=False)
    assert code != 0 and "'GPT2LMHeadModel' is not in megappo's registry" in out


def test_checkpoint_shapes_from_another_model(tmp_path):
    hf = tmp_path / "hf"
    make_hf_dir(hf, "llama")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=256)))
    code, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(tmp_path / "o"), check=False)
    assert code != 0 and "shape mismatch" in out and "another model" in out
    assert not (tmp_path / "o").exists()


def test_failed_verification_leaves_no_output(tmp_path):
    hf = tmp_path / "hf"
    make_hf_dir(hf, "llama")
    shard = next(hf.glob("model-00001-*.safetensors"))
    tensors = load_file(str(shard))
    name = next(iter(tensors))
    tensors[name][0] = float("nan")  # NaN != NaN: the bit-exact check must fail
    save_file(tensors, str(shard))
    code, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf), "--out", str(tmp_path / "o"),
                         "--verify", check=False)
    assert code != 0 and "not bit-exact" in out
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.tmp-*"))


def test_existing_output_is_not_overwritten(tmp_path):
    make_hf_dir(tmp_path / "hf", "llama")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("x")
    code, out = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(tmp_path / "hf"), "--out",
                         str(tmp_path / "o"), check=False)
    assert code != 0 and "--overwrite" in out and (tmp_path / "o" / "keep.txt").exists()


@pytest.mark.one_process  # no rank starts (tests/conftest.py)
def test_user_errors_are_one_line_naming_the_flag(tmp_path):
    """A mistake on the command line: one `megappo: error:` line that names the tool's flag (not the
    recipe key), exit code 2, no traceback, nothing written."""
    make_hf_dir(tmp_path / "hf", "llama")
    cases = [
        (("convert_hf_to_megatron.py", "--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")),
         "--hf-dir '" + str(tmp_path / "nope") + "' has no config.json"),
        (("convert_hf_to_megatron.py", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "o"), "--tp", "3"),
         "Fix: choose --tp from [1, 2] and --pp from [1, 2, 4]."),
        (("convert_megatron_to_hf.py", "--ckpt", str(tmp_path / "hf"), "--out", str(tmp_path / "o")),
         "is not a megappo model checkpoint (no megappo_model.json). Fix: pass --ckpt a directory"),
    ]
    for args, message in cases:
        code, out = run_tool(*args, check=False)
        assert code == 2, out
        assert out.startswith("megappo: error: ") and len(out.strip().splitlines()) == 1, out
        assert message in out and "Traceback" not in out and "parallel.tp" not in out, out
        assert not (tmp_path / "o").exists()
    trainer_step = tmp_path / "run" / "checkpoints" / "step_00000002"  # a trainer checkpoint given as --ckpt
    (trainer_step / "actor").mkdir(parents=True)
    (trainer_step / "trainer_state.json").write_text("{}")
    code, out = run_tool("convert_megatron_to_hf.py", "--ckpt", str(trainer_step), "--out", str(tmp_path / "o"),
                         check=False)
    assert code == 2 and f"pass --ckpt {trainer_step / 'actor'} (or critic), or use `megappo export" in out, out
