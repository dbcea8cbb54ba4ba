"""One PPO step, readable top to bottom (`ppo_step`), and the stage helpers it composes.

Every rank runs this program (SPMD under torchrun). Global rank 0 also owns the rollout
engine, the prompts, the reward functions, the KL controller, the advantages, logging and
progress; tensors it produces are broadcast, per-sample results of the models come back
to it (`megappo.trainer.roles`). Setup (models, engine, data, checkpoints) lives in
`megappo.trainer.setup`; the loop around the step in `megappo.trainer.loop`.
When each step's batch is generated (now, or during the previous step: `rollout.mode`) is
`run.rollouts` (megappo.rollout.schedule); `generate` is what a generation does (with
algorithm.filter_groups: rounds of generation and scoring, megappo.rollout.dynamic_sampling, the batch
carrying its scores and metrics to the step that trains on it). With algorithm.use_pf_ppo the step
trains on its samples resampled by score after the advantages (`pf_ppo`, PF-PPO).

This module does not know how models are built or sharded, nor when steps run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from megappo.rollout.dynamic_sampling import DynamicSampling, GroupFilter, fill_batch
from megappo.envs.loading import env_class
from megappo.parallel import cpu_compat
from megappo.parallel.comm import broadcast_from_rank0
from megappo.parallel.stage import stage
from megappo.metrics.perf import flop_rate_metrics, peak_memory
from megappo.ppo.advantages import compute_advantage
from megappo.ppo.kl import apply_kl_penalty
from megappo.ppo.pf_ppo import resample_indices
from megappo.ppo.rollout_correction import rollout_correction
from megappo.rollout.bridge import logprob_mismatch
from megappo.rollout.multiturn import observation_encoder, run_episodes
from megappo.rollout.partial import token_age_metrics
from megappo.trainer.setup import Run
from megappo.metrics.sample_log import pick_samples, write_generations
from megappo.types import RolloutBatch, SamplingParams
from megappo.trainer.roles import Experience, SeqBatch, TokenStats, pass_metrics


@contextlib.contextmanager
def timed(metrics: dict, name: str):
    """`timing_s/<name>` and, on CUDA, the stage's peak memory (megappo.metrics.perf); `name` is also the
    stage a timed-out collective inside reports."""
    start = time.perf_counter()
    with stage(name), peak_memory(metrics, name):
        yield
    metrics[f"timing_s/{name}"] = time.perf_counter() - start


def ppo_step(run: Run, step: int) -> dict[str, float]:
    m = {}
    with timed(m, "gen"):
        batch = broadcast_from_rank0(run.rollouts.next_batch(step, lambda k: generate(run, k))
                                     if run.ps.is_rank0 else None)
    seqs = to_seqs(batch)
    pending = run.scorer.start(batch) if run.ps.is_rank0 else None  # reward workers score during the passes below
    old = TokenStats(None)  # bypass: the engine's log-probs are the old ones, no recompute
    if not run.cfg.bypass_old_logprobs:
        with timed(m, "old_log_prob"):
            old = run.actor.token_stats(seqs, entropy=True, sum_pi_squared=run.cfg.algorithm.estimator.sum_pi_squared)
    with timed(m, "ref"):
        ref_lp = run.ref.log_probs(seqs) if run.ref else None
    with timed(m, "values"):
        values = run.critic.values(seqs) if run.critic else None
    with timed(m, "reward_model"):
        rm_scores = run.reward_model.scores(seqs) if run.reward_model else None
    with timed(m, "adv"):  # rank 0 scores and computes advantages while the others wait for them
        exp, adv_metrics = (experience(run, step, batch, seqs, pending, old, ref_lp, values, rm_scores)
                            if run.ps.is_rank0 else (None, {}))
        m.update(adv_metrics)
        exp = broadcast_from_rank0(exp)
    if run.critic:
        with timed(m, "update_critic"):
            m.update(run.critic.update(exp, **run.critic_update_args(step)))
    if not critic_warmup(run, step):  # warmup: the actor, and so the engine's weights, stay as they are
        with timed(m, "update_actor"):
            m.update(run.actor.update(exp, **run.actor_update_args(step)))
        with timed(m, "weight_sync"):
            m.update(run.bridge.sync().metrics())
    m.update(pass_metrics([run.actor, run.ref, run.critic, run.reward_model]))
    m.update(flop_metrics(run, m))
    return m



def experience(run: Run, step: int, batch: RolloutBatch, seqs: SeqBatch, pending, old: TokenStats, ref_lp, values,
               rm_scores) -> tuple[Experience, dict[str, float]]:
    """Rank 0: the batch scored (the reward workers' `pending` results, the reward model's `rm_scores`), the
    experience made from it (KL in the reward, advantages, returns), the rollout's metrics and logged samples;
    resampled by score under PF-PPO. The experience and the metrics of all that."""
    m = {}
    with timed(m, "reward"):
        scored = run.scorer.score_step(batch, pending, reward_model=rm_scores)
        m.update(scored.metrics)
        m.update(batch.gen_metrics or {})  # the generation's own (dynamic sampling; one_step_off, async)
    scores = scored.scores
    exp, exp_metrics = make_experience(run, batch, seqs, scores, old.log_probs, ref_lp, values,
                                       sum_pi_squared=old.sum_pi_squared, components=reward_components(run, batch),
                                       skip=scored.skip)
    m.update(exp_metrics)
    m.update(rollout_metrics(batch, scores, exp, old.entropy, run.cfg.data.max_prompt_length))
    m.update(token_age_metrics(batch, step - 1))  # partial rollouts: tokens of earlier policy versions
    log_generations(run, step, batch, scores)
    if run.cfg.algorithm.use_pf_ppo:
        exp, m["pf_ppo/unique_fraction"] = pf_ppo(run, step, exp, scores)
    return exp, m

#: (role, pass) -> (the timed stage those passes run in, the name of their perf/tflops and perf/mfu metrics)
FLOP_STAGES = {("actor", "forward"): ("old_log_prob", "old_log_prob"), ("ref", "forward"): ("ref", "ref"),
               ("critic", "forward"): ("values", "values"), ("reward", "forward"): ("reward_model", "reward_model"),
               ("actor", "train"): ("update_actor", "actor"), ("critic", "train"): ("update_critic", "critic")}


def log_generations(run: Run, step: int, batch: RolloutBatch, scores: torch.Tensor) -> None:
    """Rank 0: logging.samples of the step's generations to the logger, and with logging.rollout_dir every
    one of them to <dir>/<step>.jsonl (megappo.metrics.sample_log)."""
    run.logger.add_samples(step, pick_samples(run.tokenizer, batch, scores, run.cfg.logging.samples))
    if run.cfg.logging.rollout_dir:
        write_generations(run.cfg.logging.rollout_dir, step, pick_samples(run.tokenizer, batch, scores, -1))


def critic_warmup(run: Run, step: int) -> bool:
    """Steps 1..run.critic_warmup train the critic alone (verl's trainer.critic_warmup): no actor update,
    so no optimizer or LR-scheduler step and no actor/* metrics (verl logs none either), and no weight
    sync, since the engine already holds the actor's unchanged weights."""
    return step <= run.cfg.run.critic_warmup


def flop_metrics(run: Run, m: dict) -> dict[str, float]:
    """`perf/tflops/<name>` (and `perf/mfu/<name>` where the GPU's peak is known) of the stages that
    ran model passes this step: their model FLOPs over their `timing_s`."""
    stages = {}
    for worker in (run.actor, run.ref, run.critic, run.reward_model):
        for kind, flops in (worker.take_flops() if worker else {}).items():
            stage_name, name = FLOP_STAGES[(worker.model.role, kind)]
            if f"timing_s/{stage_name}" in m:  # a pass outside its stage is not rated
                stages[name] = (flops, m[f"timing_s/{stage_name}"])
    return flop_rate_metrics(stages, world_size=run.ps.world_size, peak=run.peak_tflops)


def generate(run: Run, step: int) -> RolloutBatch:
    cfg = run.cfg.rollout
    params = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                            max_new_tokens=cfg.max_new_tokens, eos_token_ids=run.eos_ids,
                            stop_token_ids=tuple(cfg.stop_token_ids), seed=cfg.seed + step,
                            logprob_mode=cfg.logprob_mode, return_routes=run.build.routing_replay)
    if run.partial:  # the first groups to finish; unfinished samples carried to later steps, resumed first
        bad_before, dynamic = run.scorer.checks.bad_values, dynamic_sampling(run)
        batch = run.partial.next_batch(step, params,
                                       draw=lambda: draw_prompts(run),
                                       generate=lambda prompt_ids, call: engine_generate(run, prompt_ids, call),
                                       dynamic=dynamic)
        if dynamic:
            batch.gen_metrics["reward/bad_values"] = float(run.scorer.checks.bad_values - bad_before)
        prompts = group_prompts(batch)
    elif run.cfg.algorithm.filter_groups.enable:  # DAPO: scored rounds until the batch holds informative groups
        batch = sample_dynamically(run, step, params)
        prompts = group_prompts(batch)
    else:
        prompts = draw_prompts(run)
        batch = rollout(run, prompts, params)
    if run.cfg.algorithm.estimator.greedy_baseline:  # ReMax: the greedy response's reward is the baseline
        greedy = rollout(run, prompts, dataclasses.replace(params, n=1, temperature=0.0, return_routes=False))
        batch.reward_baselines = run.scorer.totals(greedy)[batch.prompt_index]
        batch.gen_metrics = {**(batch.gen_metrics or {}), **spread("critic/remax_baseline", batch.reward_baselines)}
    run.engine.free_cache()  # the hf engine's KV cache is not kept through the trainer's passes
    return batch


def draw_prompts(run: Run) -> list:
    """The sampler's next batch of training prompts (their records)."""
    return [run.train_examples[i] for i in run.sampler.next_batch()]


def sample_dynamically(run: Run, step: int, params: SamplingParams) -> RolloutBatch:
    """algorithm.filter_groups (megappo.rollout.dynamic_sampling): generation batches of data.gen_batch_size prompts,
    scored here, until data.train_batch_size groups whose samples differ are kept."""
    bad_before = run.scorer.checks.bad_values
    batch = fill_batch(GroupFilter.of(run.cfg), step=step, seed=params.seed,
                       draw=lambda: draw_prompts(run),
                       generate=lambda prompts, seed: rollout(run, prompts, dataclasses.replace(params, seed=seed)),
                       score=run.scorer.generation_scores, pad_token_id=run.tokenizer.pad_token_id,
                       limits=run.filter_limits)
    batch.gen_metrics["reward/bad_values"] = float(run.scorer.checks.bad_values - bad_before)
    return batch


def dynamic_sampling(run: Run) -> DynamicSampling | None:
    """algorithm.filter_groups inside partial rollouts: each group scored and judged as it completes."""
    if not run.cfg.algorithm.filter_groups.enable:
        return None
    return DynamicSampling(GroupFilter.of(run.cfg), run.scorer.generation_scores, run.filter_limits)


def group_prompts(batch: RolloutBatch) -> list:
    """The prompt record of each group, in prompt_index order."""
    first: dict[int, int] = {}
    for i, g in enumerate(batch.prompt_index.tolist()):
        first.setdefault(g, i)
    return [batch.examples[first[g]] for g in range(len(first))]


def rollout(run: Run, prompts: list, params: SamplingParams) -> RolloutBatch:
    """`params.n` responses per prompt: the engine's (rollout.env=single_turn), or episodes of
    rollout.env played through the engine (megappo.rollout.multiturn)."""
    cfg = run.cfg.rollout
    if cfg.env == "single_turn":
        batch = engine_generate(run, [p.prompt_ids for p in prompts], params)
    else:
        env = env_class(cfg.env)
        batch = run_episodes(
            lambda contexts, turn_params: engine_generate(run, contexts, turn_params), prompts, params,
            make_env=lambda: env(**cfg.env_args), tokenizer=run.tokenizer,
            encode_observation=observation_encoder(run.tokenizer, env.observation_role, run.cfg.data.apply_chat_template,
                                                   cfg.bad_observation_policy, run.cfg.data.apply_chat_template_kwargs),
            max_turns=cfg.max_turns, max_turn_tokens=cfg.max_turn_tokens, pad_token_id=run.tokenizer.pad_token_id)
    batch.examples = [prompts[i] for i in batch.prompt_index.tolist()]
    return batch


def engine_generate(run: Run, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutBatch:
    # the engine never names a CUDA device: the CPU compatibility layer's device remapping
    # (a torch function mode, active only on CPU) is suspended around it, same results
    with cpu_compat.suspended():
        return run.engine.generate(prompt_ids, params)


def to_seqs(batch: RolloutBatch) -> SeqBatch:
    ids, mask = batch.sequences()
    return SeqBatch(input_ids=ids, attention_mask=mask, response_mask=batch.response_mask,
                    prompt_len=batch.prompt_ids.shape[1], routes=batch.routes)


def reward_components(run: Run, batch: RolloutBatch) -> torch.Tensor | None:
    """[N, K] each GDPO component's score (one reward function each, unweighted; from the batch's
    scoring, `rewards`); None for other estimators."""
    if not run.cfg.algorithm.estimator.components:
        return None
    return batch.score_components[:, [run.cfg.reward.functions.index(n) for n in run.cfg.gdpo_components]]


def make_experience(run: Run, batch: RolloutBatch, seqs: SeqBatch, scores, old_lp, ref_lp, values, *,
                    sum_pi_squared=None, components=None, skip=None) -> tuple[Experience, dict[str, float]]:
    """Rank 0: the batch's training record (old log-probs, in-reward KL, rollout correction, advantages and
    returns, the loss mask) from its [N] `scores` and the step's passes, and what it logs of them. `skip`: [N]
    bool, samples of groups the judge skipped (reward.judge.on_failure=skip_group): their rows of the mask are 0
    from the start, so they count in no advantage, baseline, whitening or loss."""
    cfg, m = run.cfg, {}
    last = last_action_token(batch.response_mask)
    mask = batch.response_mask if skip is None else batch.response_mask * ~skip[:, None]
    token_scores = torch.zeros_like(mask, dtype=torch.float32)
    token_scores[torch.arange(len(last)), last] = scores  # the sequence score sits on its last action token
    rollout_lp = batch.rollout_log_probs
    if old_lp is None:  # bypass; the mismatch shows as the first micro-batch's actor/ppo_kl
        old_lp = rollout_lp
    else:
        m.update(logprob_mismatch(rollout_lp, old_lp, mask))
    token_rewards = token_scores
    if cfg.algorithm.use_kl_in_reward:
        token_rewards, kl_metrics = apply_kl_penalty(token_scores, old_lp, ref_lp, mask, run.kl_ctrl,
                                                     kl_penalty=cfg.algorithm.kl_penalty)
        m.update(kl_metrics)
    is_weights, mask, correction_metrics = correct_rollout(cfg.rollout_correction, old_lp, rollout_lp, mask)
    m.update(correction_metrics)
    adv, ret = advantages(cfg.algorithm, token_rewards, mask, values, batch, old_log_probs=old_lp,
                          sum_pi_squared=sum_pi_squared, rollout_is_weights=is_weights, reward_components=components,
                          reward_component_weights=cfg.algorithm.gdpo_reward_weights)
    m.update(spread("critic/rewards", token_rewards.sum(-1)))
    if cfg.algorithm.mask_truncated_completions:
        mask, m["response_length/masked_truncated"] = mask_truncated(batch, mask)
    return Experience(seqs=dataclasses.replace(seqs, response_mask=mask), old_log_probs=old_lp, advantages=adv,
                      ref_log_probs=ref_lp, values=values, returns=ret, rollout_is_weights=is_weights), m


def pf_ppo(run: Run, step: int, exp: Experience, scores: torch.Tensor) -> tuple[Experience, float]:
    """PF-PPO (algorithm.use_pf_ppo): the step's samples drawn again with replacement, weighted by their
    scores (megappo.ppo.pf_ppo), from a generator seeded by (run.seed, step), so a resumed run draws the same;
    and pf_ppo/unique_fraction, the share of the generated samples the update sees (the step's data metrics
    are the generated batch's)."""
    p = run.cfg.algorithm.pf_ppo
    rows = resample_indices(scores.detach().float().cpu(), p.reweight_method, p.weight_pow,
                            generator=torch.Generator().manual_seed(run.cfg.run.seed * 1_000_003 + step))
    return exp.select(rows), rows.unique().numel() / rows.numel()


def mask_truncated(batch: RolloutBatch, mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """algorithm.mask_truncated_completions: [N, R] `mask` with the rows of responses that ran into
    rollout.max_new_tokens zeroed, so they carry no actor or critic loss, and the fraction of such rows
    (`response_length/masked_truncated`). Applied after the advantages: they still count in their
    group's baseline (TRL)."""
    truncated = batch.truncated
    return mask * ~truncated[:, None], truncated.float().mean().item()


def correct_rollout(rc, old_lp, rollout_lp, mask):
    """Decoupled rollout correction (megappo.ppo.rollout_correction), once for the whole batch: ([N, R]
    importance weights or None, [N, R] the response mask with rejected tokens 0, its metrics). Bypass mode
    corrects inside the loss instead, so here it changes nothing."""
    if not rc.enabled or rc.bypass_mode or not mask.any():
        return None, mask, {}
    is_weights, kept, metrics = rollout_correction(
        old_lp, rollout_lp, mask, rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold)
    if is_weights is not None:  # megappo's name before rollout_corr/*; kept for actor.old_logprob=is_correct runs
        metrics["rollout/is_weight_mean"] = (is_weights.sum() / mask.sum()).item()
    return is_weights, kept, metrics


def last_action_token(mask: torch.Tensor) -> torch.Tensor:
    """[N, R] response mask -> [N] column of each row's last generated token (0 for an empty row);
    observation tokens (mask 0) may follow or sit between the actions."""
    cols = torch.arange(1, mask.shape[1] + 1).expand_as(mask)
    return ((cols * mask.bool()).amax(-1) - 1).clamp(min=0) if mask.shape[1] else mask.new_zeros(mask.shape[0])


def advantages(algo, token_rewards, mask, values, batch: RolloutBatch, **inputs):
    """The estimator named in the config, given every input it might need."""
    return compute_advantage(algo.adv_estimator, token_level_rewards=token_rewards, response_mask=mask,
                             values=values, index=batch.prompt_index, gamma=algo.gamma, lam=algo.lam,
                             reward_baselines=batch.reward_baselines,
                             norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, **inputs)


def rollout_metrics(batch: RolloutBatch, scores, exp: Experience, entropy, max_prompt_length: int) -> dict[str, float]:
    """verl's data metrics of a step's batch (its compute_data_metrics): scores, advantages, returns and values
    (mean / max / min over the response tokens), response and prompt lengths, and the rollout's entropy."""
    mask = batch.response_mask.bool()
    lengths = batch.real_response_mask.sum(-1).float()
    prompts = batch.prompt_mask.sum(-1).float()
    out = {
        **spread("critic/score", scores),
        **spread("critic/advantages", exp.advantages[mask]),
        **spread("response_length", lengths),
        **spread("prompt_length", prompts),
        "prompt_length/clip_ratio": (prompts >= max_prompt_length).float().mean().item(),
        "perf/total_num_tokens": float(batch.prompt_mask.sum() + batch.real_response_mask.sum()),
        "response_length/clip_ratio": batch.clip_ratio,
        **(batch.env_metrics or {}),
    }
    if entropy is not None:
        out["actor/rollout_entropy"] = entropy[mask].mean().item()
    if exp.returns is not None:
        out.update(spread("critic/returns", exp.returns[mask]))
    if exp.values is not None:
        out.update(spread("critic/values", exp.values[mask]))
        ret, val = exp.returns[mask], exp.values[mask]
        out["critic/vf_explained_var"] = (1 - (ret - val).var() / (ret.var() + 1e-8)).item()
    return out


def spread(name: str, values: torch.Tensor) -> dict[str, float]:
    """`<name>/mean`, `/max`, `/min` of `values` (NaN for none, as verl logs them)."""
    values = values.float()
    if not values.numel():
        return {f"{name}/{k}": float("nan") for k in ("mean", "max", "min")}
    return {f"{name}/mean": values.mean().item(), f"{name}/max": values.max().item(), f"{name}/min": values.min().item()}
