"""megappo.plan.fixes: what `megappo plan` offers when a recipe does not fit, on the shipped recipes.

Every offered change is planned again here from the recipe with its overrides (megappo.config.loading +
megappo.plan.planner, as a user who types them would get), and the claims "nothing fits on these GPUs" are
checked against a brute force over layouts and SGLang memory fractions with every other memory
saving on.
"""

import copy
import os

import pytest

from megappo.cli import main
from megappo.errors import ConfigError
from megappo.models.hf_config import ModelConfigError
from megappo.plan.planner import GIB, RESERVE_GIB, format_plan, make_plan
from megappo.plan.fixes import MAX_SHOWN, find_fixes, format_fixes
from megappo.config import apply_override, config_from_dict, load_config, read_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN_PPO = os.path.join(REPO, "recipes", "qwen2.5-7b-ppo-8gpu.yaml")
LLAMA_LORA = os.path.join(REPO, "recipes", "llama3.3-70b-lora-grpo-8gpu.yaml")


def fixes_for(path, overrides=(), gpu_mem=None):
    cfg, _ = read_config(path, list(overrides))
    plan = make_plan(cfg, gpu_mem_gib=gpu_mem)
    return plan, find_fixes(cfg, plan, recipe=path, overrides=list(overrides))


def replanned(path, overrides, fix, gpu_mem):
    """The plan a user gets by adding the fix's overrides (the world: the recipe's hardware with them)."""
    return make_plan(load_config(path, [*overrides, *fix.overrides]), gpu_mem_gib=gpu_mem)


def anything_fits(path, overrides, gpu_mem, nodes, savers, tp_sizes=(1, 2, 4, 8)):
    """Brute force: every layout of nodes x 8 GPUs (tp within a node) with the memory savers `savers`
    on, at SGLang memory fractions 0.05, 0.10, ... up to the first whose KV cache holds a sequence
    (a larger pool only adds to the total)."""
    data = load_config(path, list(overrides)).to_dict()
    world = nodes * 8
    for tp in tp_sizes:
        for pp in (q for q in range(1, world // tp + 1) if world % (tp * q) == 0):
            for frac in range(5, 100, 5):
                trial = copy.deepcopy(data)
                for o in [f"hardware.nodes={nodes}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                          f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}", *savers,
                          f"rollout.sglang.mem_fraction_static={frac / 100}"]:
                    apply_override(trial, o)
                try:
                    plan = make_plan(config_from_dict(trial), gpu_mem_gib=gpu_mem)
                except (ConfigError, ModelConfigError):  # a layout the model or the batch cannot use
                    break
                if plan.engine.kv_tokens >= plan.seq or plan.total > plan.gpu_mem:
                    if plan.fits:
                        return True
                    break
    return False


def test_qwen_7b_ppo_on_40gb_gpus_names_the_variant_and_the_gpus_it_needs():
    """8 x 40 GiB: nothing fits (the old first fix, tp=4 pp=2, planned 52.0); the recipe's 16x40gb
    variant fits, and so do 16 GPUs with the changes named."""
    plan, fixes = fixes_for(QWEN_PPO, gpu_mem=40)
    assert not plan.fits and plan.world_size == 8
    assert fixes.alone == () and fixes.together is None
    assert not replanned(QWEN_PPO, [], fixes.closest, 40).fits
    savers = ["actor.recompute.granularity=full", "critic.recompute.granularity=full",
              "actor.max_tokens_per_micro_batch=1536", "critic.max_tokens_per_micro_batch=1536",
              "model.lm_head_chunk_tokens=1024"]
    assert not anything_fits(QWEN_PPO, [], 40, 1, savers, tp_sizes=(1, 2, 4))  # 4 KV heads: tp <= 4

    assert fixes.variant.name == "16x40gb"
    assert fixes.variant.command == f"megappo plan {QWEN_PPO} --variant 16x40gb"
    assert main(fixes.variant.command.split()[1:]) == 0  # the command, run: it fits
    variant = make_plan(load_config(QWEN_PPO, variant="16x40gb"), gpu_mem_gib=40)
    assert variant.fits and variant.total == fixes.variant.plan.total

    more = fixes.more_gpus
    assert more.plan.world_size == 16 and "hardware.nodes=2" in more.overrides
    again = replanned(QWEN_PPO, [], more, 40)
    assert again.fits and again.world_size == 16 and again.total == more.plan.total
    text = format_fixes(fixes, plan)
    assert "nothing fits on 1 node x 8 GPUs of 40 GiB" in text and "16x40gb" in text
    assert f"16 GPUs fit (2 nodes x 8 GPUs of 40 GiB; tp {again.tp} x pp {again.pp} x dp {again.dp})" in text
    assert "parallel.tp=4 parallel.pp=2" not in text and len(text.splitlines()) <= 1 + MAX_SHOWN + 2


def test_llama_70b_full_finetune_says_how_many_gpus():
    """actor.lora.rank=0 on 8 x 80 GiB: no fix fits, no variant does; neither SGLang's tp size (8, the
    node's GPUs) nor sequence parallelism is offered; 32 GPUs do, with the layout named."""
    overrides = ["actor.lora.rank=0"]
    plan, fixes = fixes_for(LLAMA_LORA, overrides)
    assert not plan.fits and plan.engine.tp_size == 8
    assert fixes.alone == () and fixes.together is None and fixes.variant is None
    assert not make_plan(load_config(LLAMA_LORA, overrides, variant="h200"), gpu_mem_gib=80).fits
    text = format_fixes(fixes, plan)
    assert "rollout.sglang.tp_size" not in text
    more = fixes.more_gpus
    assert more.plan.world_size == 32 and "hardware.nodes=4" in more.overrides
    again = replanned(LLAMA_LORA, overrides, more, 80)
    assert again.fits and again.total == more.plan.total
    assert f"32 GPUs fit (4 nodes x 8 GPUs of 80 GiB; tp {again.tp} x pp {again.pp} x dp {again.dp})" in text
    savers = ["actor.max_tokens_per_micro_batch=3072", "model.lm_head_chunk_tokens=1024"]
    for nodes in (1, 2, 3):  # fewer GPUs: nothing fits
        assert not anything_fits(LLAMA_LORA, overrides, 80, nodes, savers), nodes


def test_fixes_alone_fit_when_planned_and_are_ranked_by_saving():
    overrides = ["parallel.use_distributed_optimizer=false"]
    plan, fixes = fixes_for(QWEN_PPO, overrides)
    assert not plan.fits and len(fixes.alone) >= 2 and fixes.more_gpus is None
    totals = []
    for fix in fixes.alone:
        again = replanned(QWEN_PPO, overrides, fix, 80)
        assert again.fits and again.world_size == 8, fix.overrides
        assert fix.saved == pytest.approx(plan.total - again.total)
        totals.append(again.total)
    assert totals == sorted(totals)  # the largest saving first
    offered = " ".join(f.text for f in fixes.alone)
    assert "parallel.use_distributed_optimizer=true" in offered
    # already on, or impossible (SGLang tp 8 does not split 28 heads; tp 8 not the 4 KV heads)
    assert "sequence_parallel" not in offered and "tp_size" not in offered and "parallel.tp=8" not in offered
    lines = format_fixes(fixes, plan).splitlines()
    assert lines[0] == "fixes, each planned with it applied (largest saving first):"
    assert lines[1:1 + len(fixes.alone[:MAX_SHOWN])] == [
        f"  - {f.text}: {f.plan.total / GIB:.1f} GiB" for f in fixes.alone[:MAX_SHOWN]]


def test_no_single_fix_fits_the_fewest_together_do():
    """8 x 48 GiB: no change fits alone; the combination offered fits and none of its parts can go."""
    plan, fixes = fixes_for(QWEN_PPO, gpu_mem=48)
    assert fixes.alone == () and fixes.together is not None and fixes.more_gpus is None
    together = fixes.together
    assert len(together.overrides) >= 2 and replanned(QWEN_PPO, [], together, 48).fits
    for dropped in together.overrides:
        rest = [o for o in together.overrides if o != dropped]
        try:
            assert not make_plan(load_config(QWEN_PPO, rest), gpu_mem_gib=48).fits, dropped
        except ConfigError:  # refused without it (an SGLang tp size with the replicas that fit beside each other)
            assert dropped.startswith("rollout.replicas="), dropped
    assert fixes.variant.name == "8x48gb" and fixes.variant.plan.fits
    assert f"  - {together.text}: {together.plan.total / GIB:.1f} GiB" in format_fixes(fixes, plan)


def test_sglang_memory_fraction_is_solved_and_planned():
    """A pool of 0.9 leaves the trainer no room: the fraction offered fits, its KV cache holds a sequence."""
    overrides = ["rollout.sglang.mem_fraction_static=0.9"]
    plan, fixes = fixes_for(QWEN_PPO, overrides)
    fraction = [f for f in fixes.alone if f.overrides[0].startswith("rollout.sglang.mem_fraction_static=")]
    assert not plan.fits and len(fraction) == 1
    good = replanned(QWEN_PPO, overrides, fraction[0], 80)
    frac = float(fraction[0].overrides[0].split("=")[1])
    assert 0 < frac < 0.9 and good.fits and good.engine.kv_tokens >= good.seq
    # the engine's pool is its fraction of what the trainer left free when it started
    start = sum(r.weights + r.grads + r.master for r in good.roles) + RESERVE_GIB * GIB
    assert good.engine.pool == pytest.approx(frac * (80 * GIB - start))


def test_everything_fits_no_fixes(capsys):
    cfg = load_config(QWEN_PPO)
    plan = make_plan(cfg)
    assert plan.fits
    fixes = find_fixes(cfg, plan, recipe=QWEN_PPO)
    assert (fixes.alone, fixes.together, fixes.closest, fixes.more_gpus) == ((), None, None, None)
    assert main(["plan", QWEN_PPO]) == 0
    out = capsys.readouterr().out
    assert "\nfits: " in out and "does NOT fit" not in out and "fixes" not in out and "  - " not in out
    assert main(["plan", QWEN_PPO, "--gpu-mem", "40"]) == 1
    out = capsys.readouterr().out
    assert format_plan(make_plan(cfg, gpu_mem_gib=40)) in out and "\ndoes NOT fit: 17.3 GiB over\n" in out


def test_a_variant_that_trains_the_same_comes_first():
    """qwen2.5-72b with pp=4 on 64 GPUs: grpo-32gpu fits on fewer GPUs but trains GRPO without a critic;
    128gpu trains the same PPO and is the one named."""
    path = os.path.join(REPO, "recipes", "qwen2.5-72b-ppo-64gpu.yaml")
    overrides = ["parallel.pp=4"]
    plan, fixes = fixes_for(path, overrides)
    grpo = make_plan(load_config(path, overrides, variant="grpo-32gpu"))
    assert not plan.fits and grpo.fits and grpo.world_size < plan.world_size
    assert fixes.variant.name == "128gpu" and fixes.variant.changes == ()
    assert make_plan(load_config(path, overrides, variant="128gpu")).fits
    assert f"megappo plan {path} parallel.pp=4 --variant 128gpu" in format_fixes(fixes, plan)


@pytest.mark.parametrize("argv,intro", [
    (["recipes/qwen2.5-7b-ppo-8gpu.yaml", "--gpu-mem", "40"], "(8 GPUs of 40 GiB) ends:"),
    (["recipes/llama3.3-70b-lora-grpo-8gpu.yaml", "actor.lora.rank=0"], "no variant fits 80 GiB:")])
def test_docs_quote_what_the_planner_prints(argv, intro, capsys, monkeypatch):
    """docs/planner.md's fixes section quotes these runs' last lines as they print today."""
    monkeypatch.chdir(REPO)  # the commands in the output name the recipe as given
    with open(os.path.join(REPO, "docs", "planner.md")) as f:
        text = f.read()
    quoted = text[text.index(intro):].split("```\n")[1]
    assert main(["plan", *argv]) == 1
    out = capsys.readouterr().out
    assert quoted in out and "does NOT fit" in quoted


def test_a_wider_sglang_replica_comes_with_fewer_replicas():
    """The Qwen 7B PPO recipe runs 8 SGLang replicas of tp 1; with a pool of 0.2 its 14.2 GiB of weights do not
    fit in one GPU's pool. Wider engines are offered with as many replicas as then fit beside each other
    (tp 2: 4 replicas), each planned."""
    overrides = ["rollout.sglang.mem_fraction_static=0.2"]
    plan, fixes = fixes_for(QWEN_PPO, overrides)
    assert not plan.fits and plan.engine.kv_tokens == 0 and plan.placement.replicas == 8
    wider = [f for f in fixes.alone if f.overrides == ("rollout.sglang.tp_size=2", "rollout.replicas=4")]
    assert len(wider) == 1
    again = replanned(QWEN_PPO, overrides, wider[0], 80)
    assert again.fits and again.placement.engine_ranks == frozenset(range(8))


def test_fewer_replicas_when_a_staged_update_does_not_fit():
    """hardware.device=cpu, 2 ranks of 273 GiB, Qwen 7B PPO with the hf engine on each: rank 1 also stages
    each update (14.2 GiB, more than its 9.4 GiB of activations) and goes over; rollout.replicas=1 fits."""
    cfg = config_from_dict({
        "model": {"path": "/nonexistent/Qwen2.5-7B-Instruct", "dtype": "bfloat16"},
        "hardware": {"device": "cpu", "gpus_per_node": 2, "gpu_memory_gib": 273},
        "actor": {"ppo_mini_batch_size": 8, "micro_batch_size": 1},
        "critic": {"ppo_mini_batch_size": 8, "micro_batch_size": 1},
        "rollout": {"engine": "hf", "max_new_tokens": 1024, "replicas": 2},
        "data": {"max_prompt_length": 512, "train_batch_size": 8}})
    plan = make_plan(cfg)
    assert not plan.fits and plan.rank == 1 and plan.staged > plan.peak_activation.activations
    one = [f for f in find_fixes(cfg, plan).alone if f.overrides == ("rollout.replicas=1",)]
    assert len(one) == 1 and one[0].plan.fits and one[0].plan.placement.replicas == 1


def test_a_long_response_that_no_longer_fits_gets_context_parallelism_first():
    """Qwen2.5-7B PPO on 8 x 80 GiB with 64K-token responses, recomputation and the chunked LM head already
    on: the activations of one sequence are what is left, and splitting them over 2 ranks is the largest
    saving; the plan a user gets with it fits."""
    overrides = ["rollout.max_new_tokens=65536", "model.layer_spec=local", "actor.recompute.granularity=full",
                 "critic.recompute.granularity=full", "model.lm_head_chunk_tokens=1024"]
    plan, fixes = fixes_for(QWEN_PPO, overrides)
    assert not plan.fits
    first = fixes.alone[0]
    assert first.overrides == ("parallel.cp=2",), [f.overrides for f in fixes.alone]
    assert replanned(QWEN_PPO, overrides, first, None).fits
    assert "parallel.cp=2" in format_fixes(fixes, plan)
