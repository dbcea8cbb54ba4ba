"""The four PPO roles on Megatron models: actor, reference, critic, reward model.

Every method is a collective over all ranks (SPMD). Inputs are global batches that every
rank holds (broadcast by the orchestrator); each role's MicroBatching (packed by a token
budget, or padded: `megappo.parallel.packing`) decides which rows each DP replica runs in
which micro-batch, the replica runs them through the pipeline schedule
(`megappo.models.forward` / `megappo.models.training`), and per-sample results come back to
global rank 0 in batch order. Only the positions whose output is used reach the LM head;
log-probs and entropy are computed from TP-sharded logits without gathering the vocabulary
(`megappo.parallel.vocab_parallel`), or, with `lm_head_chunk_tokens` (model.lm_head_chunk_tokens),
from the LM head's input over token chunks, never the whole logits (`megappo.parallel.chunked_head`).

Shape legend: N samples in the global batch, m rows of a micro-batch, K selected positions
of a micro-batch, P prompt length, R response length, T = P + R, V_pad/tp vocab shard.

This module does not know about the rollout engine, rewards or the step's order.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist

from megappo.models.builders import MegatronModel
from megappo.models.flops import pass_flops
from megappo.models.forward import run_micro_batches
from megappo.models.lm_head import HeadInput
from megappo.models.moe_metrics import RouterStats
from megappo.models.routing_replay import RouteReplay
from megappo.models.training import Trainable, train_step
from megappo.parallel.chunked_head import chunked_head_log_probs_and_entropy, chunked_head_sum_pi_squared
from megappo.parallel.comm import gather_to_rank0
from megappo.parallel.packing import MicroBatching, PassCounter, Select, micro_batch_tensors, sequence_lengths
from megappo.parallel.vocab_parallel import (vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy,
                                             vocab_parallel_sum_pi_squared)
from megappo.ppo import losses as ppo_losses
from megappo.ppo.policy_losses import compute_policy_loss
from megappo.ppo.kl import kl_penalty
from megappo.ppo.rollout_correction import is_weight_sums, weights_need_batch_mean
from megappo.ppo.stats import masked_mean
from megappo.rollout.routes import fill_unknown


@dataclasses.dataclass
class SeqBatch:
    """What every role reads: prompt + response tokens, [N, T] and the response part."""

    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, R]
    prompt_len: int
    #: [N, T, L, k] int16 the rollout engine's expert ids per position and layer (-1: unknown), for
    #: MoE routing replay (megappo.rollout.routes); None without a record
    routes: torch.Tensor | None = None

    @property
    def response_ids(self) -> torch.Tensor:  # [N, R]
        return self.input_ids[:, self.prompt_len:]

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> "SeqBatch":
        """The sequences at [M] indices `rows` (repeats allowed), in that order."""
        return dataclasses.replace(self, input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
                                   response_mask=self.response_mask[rows],
                                   routes=None if self.routes is None else self.routes[rows])


@dataclasses.dataclass
class Experience:
    """Everything an update needs, [N, R] each (rank 0 builds it, all ranks hold it)."""

    seqs: SeqBatch
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> "Experience":
        """The samples at [M] indices `rows` (repeats allowed: PF-PPO's resampling), in that order."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]
        return Experience(seqs=self.seqs.select(rows), old_log_probs=pick(self.old_log_probs),
                          advantages=pick(self.advantages), ref_log_probs=pick(self.ref_log_probs),
                          values=pick(self.values), returns=pick(self.returns),
                          rollout_is_weights=pick(self.rollout_is_weights))


@dataclasses.dataclass
class TokenStats:
    """Per-token results of one policy pass, [N, R] each, on rank 0 (None elsewhere or when not asked)."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None


class _Passes:
    """What every role shares: splitting a pass into micro-batches (packed or padded, per its
    MicroBatching), counting its model FLOPs, and collecting per-row results on rank 0."""

    model: MegatronModel
    batching: MicroBatching
    counter: PassCounter
    #: model FLOPs (megappo.models.flops, all replicas) of the 'forward' and 'train' passes since `take_flops`
    flops: dict[str, float]
    #: how this model's passes use the engine's routing records (MoE); None: they do not
    routing: RouteReplay | None = None
    #: tokens per chunk of the chunked LM head (PolicyWorker); 0: the output layer builds the logits
    head_chunk: int = 0

    def _split(self, seqs: SeqBatch, rows: torch.Tensor | None, select: Select,
               per_row: dict[str, torch.Tensor | None], *, training: bool = False) -> list[dict[str, torch.Tensor]]:
        """This replica's micro-batches of `rows` (None: all) of `seqs`; their 'rows' are global ids."""
        rows = torch.arange(seqs.size) if rows is None else rows
        attn = seqs.attention_mask[rows]
        plan = self.batching.plan(attn, seqs.prompt_len, self.model.ps.dp)
        self.counter.add(plan)
        self._count_flops(plan.lengths, attn, seqs.prompt_len, select, training)
        routes = fill_unknown(seqs.routes[rows]) if self.routing and seqs.routes is not None else None
        mbs = micro_batch_tensors(plan, self.model.ps.dp_rank, seqs.input_ids[rows], attn, seqs.prompt_len,
                                  select=select, per_row={"response_mask": seqs.response_mask[rows],
                                                          **{k: v[rows] for k, v in per_row.items() if v is not None}},
                                  routes=routes)
        for mb in mbs:
            mb["rows"] = rows[mb["rows"]]
        return mbs

    def _count_flops(self, lengths, attn: torch.Tensor, prompt_len: int, select: Select, training: bool) -> None:
        """Add the pass's model FLOPs: the head runs on every response position ('response') or on
        each sequence's last token ('last')."""
        heads = int(sequence_lengths(attn, prompt_len)[1].sum()) if select == "response" else attn.shape[0]
        kind = "train" if training else "forward"
        self.flops[kind] = self.flops.get(kind, 0.0) + pass_flops(
            self.model.dims, lengths, heads, training=training, value_head=self.model.has_value_head)

    def take_flops(self) -> dict[str, float]:
        """{'forward' | 'train': FLOPs} since the last call, reset."""
        taken, self.flops = self.flops, {}
        return taken

    def _gather(self, mbs: list[dict[str, torch.Tensor]], results: list[torch.Tensor], n: int) -> torch.Tensor | None:
        """Per-micro-batch results [m, ...] of every replica -> [n, ...] in row order, on rank 0."""
        local = (torch.cat([mb["rows"] for mb in mbs]), torch.cat(results).cpu()) if results else None
        parts = [p for p in gather_to_rank0(self.model.ps, local) or () if p is not None]
        if not parts:
            return None
        rows, values = torch.cat([r for r, _ in parts]), torch.cat([v for _, v in parts])
        out = values.new_zeros((n, *values.shape[1:]))
        out[rows] = values
        return out


def pass_metrics(workers: list["_Passes | None"]) -> dict[str, float]:
    """`perf/...` of every pass since the last call (all roles, all DP replicas): the fraction of
    the token positions the models ran over that were padding, real tokens per micro-batch, and
    the number of micro-batches."""
    taken = [w.counter.take() for w in workers if w is not None]
    real, computed = sum(t.real_tokens for t in taken), sum(t.computed_tokens for t in taken)
    count = sum(t.micro_batches for t in taken)
    if not count:
        return {}
    return {"perf/padding_ratio": 1 - real / computed, "perf/tokens_per_micro_batch": real / count,
            "perf/micro_batches": float(count), **_route_metrics([w for w in workers if w is not None])}


def _route_metrics(workers: list["_Passes"]) -> dict[str, float]:
    """`rollout/moe_routes_differ_frac`: of the engine's (token, layer) routes that the MoE models'
    passes read since the last call, the fraction where the trainer's own top-k differs (summed
    over all ranks: a collective when any model reads routes, which every rank agrees on)."""
    routed = [w.routing for w in workers if w.routing is not None]
    if not routed:
        return {}
    taken = [r.take() for r in routed]  # (differ, total) of each model, reset
    counts = torch.tensor([sum(d for d, _ in taken), sum(t for _, t in taken)], dtype=torch.float64,
                          device=workers[0].model.ps.device)
    dist.all_reduce(counts)
    return {"rollout/moe_routes_differ_frac": float(counts[0] / counts[1])} if counts[1] else {}


def _placed(values: torch.Tensor, mb: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """[K] selected outputs -> [m, width] at the micro-batch's 'place' (0 elsewhere); differentiable."""
    out = values.new_zeros((len(mb["rows"]), width))
    return out.index_put((mb["place"][0], mb["place"][1]), values)


def _labels(mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[1, K] the token that each selected position predicts (the next one)."""
    sel = mb["select"]
    return mb["input_ids"][sel[1], sel[0] + 1][None]


class PolicyWorker(_Passes):
    """Actor (trainable) or reference (frozen): log-probs of response tokens, and updates."""

    def __init__(self, model: MegatronModel, *, batching: MicroBatching, temperature: float = 1.0,
                 trainable: Trainable | None = None, routing: RouteReplay | None = None, lm_head_chunk_tokens: int = 0):
        self.model, self.trainable, self.routing = model, trainable, routing
        # > 0: the passes get the head's input (megappo.models.lm_head) and megappo.parallel.chunked_head
        # computes the statistics over chunks of this many tokens
        self.head_chunk = lm_head_chunk_tokens
        self.batching, self.temperature, self.counter, self.flops = batching, temperature, PassCounter(), {}
        ps = model.ps
        per_tp = model.padded_vocab // ps.tp
        vocab_ids = torch.arange(ps.tp_rank * per_tp, (ps.tp_rank + 1) * per_tp, device=ps.device)
        self._padded_vocab = vocab_ids >= model.dims.vocab_size  # [V_pad/tp] True for padding rows
        self._has_padding = bool(self._padded_vocab.any())

    def _scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """[1, K, V_pad/tp] selected logits scaled by 1/temperature, padding rows masked. Each step
        is skipped where it would not change a bit (temperature 1, a shard without padding rows):
        each is a pass over the logits, and another in the backward. bf16 logits stay bf16 unless
        scaled: the log-prob function reads them in float32 block by block, and keeps them, not a
        float32 copy, for its backward."""
        if self.temperature != 1.0:
            logits = logits.float() / self.temperature
        if self._has_padding:
            logits = logits.masked_fill(self._padded_vocab, float("-inf"))
        return logits

    def _token_stats(self, logits: "torch.Tensor | HeadInput", mb: dict, entropy: bool):
        """[1, K, V_pad/tp] logits, or the head's input with the chunked LM head -> ([m, R] log-probs,
        [m, R] entropy or None) of the micro-batch's rows."""
        width = mb["response_mask"].shape[1]
        if isinstance(logits, HeadInput):
            lp, ent = chunked_head_log_probs_and_entropy(
                logits.hidden[0], logits.weight, _labels(mb)[0], self.model.ps.tp_group, temperature=self.temperature,
                vocab_size=self.model.dims.vocab_size, with_entropy=entropy, chunk_tokens=self.head_chunk)
            return _placed(lp, mb, width), _placed(ent, mb, width) if entropy else None
        logits, labels = self._scaled(logits), _labels(mb)
        if entropy:  # one pass over the shard for both
            lp, ent = vocab_parallel_log_probs_and_entropy(logits, labels, self.model.ps.tp_group)
            return _placed(lp[0], mb, width), _placed(ent[0], mb, width)
        return _placed(vocab_parallel_log_probs(logits, labels, self.model.ps.tp_group)[0], mb, width), None

    @torch.no_grad()
    def log_probs(self, seqs: SeqBatch, *, with_entropy: bool = False):
        """[N, R] log-probs (and [N, R] entropy) on rank 0; None elsewhere."""
        stats = self.token_stats(seqs, entropy=with_entropy)
        return (stats.log_probs, stats.entropy) if with_entropy else stats.log_probs

    @torch.no_grad()
    def token_stats(self, seqs: SeqBatch, *, entropy: bool = False, sum_pi_squared: bool = False) -> "TokenStats":
        """One pass: the [N, R] log-probs and, if asked, entropy and sum over the vocabulary of p^2 (of the
        same tempered softmax: what the optimal-token-baseline estimators read), on rank 0 (None elsewhere)."""
        mbs = self._split(seqs, None, "response", {})

        def on_output(logits, mb):
            lp, ent = self._token_stats(logits, mb, entropy)
            cols = [lp] + ([ent] if entropy else []) + ([self._sum_pi_squared(logits, mb)] if sum_pi_squared else [])
            zero = (logits.hidden if isinstance(logits, HeadInput) else logits).new_zeros(())  # no loss
            return zero, torch.stack(cols, 1) * mb["response_mask"][:, None]

        results = run_micro_batches(self.model, mbs, on_output, forward_only=True, routing=self.routing,
                                    head_input=self.head_chunk > 0)
        stacked = self._gather(mbs, results, seqs.size)
        if stacked is None:
            return TokenStats(None)
        cols = stacked.unbind(1)
        return TokenStats(cols[0], cols[1] if entropy else None, cols[-1] if sum_pi_squared else None)

    def _sum_pi_squared(self, logits: "torch.Tensor | HeadInput", mb: dict) -> torch.Tensor:
        """[1, K, V_pad/tp] selected logits (or the head's input) -> [m, R] sum of p^2 of the tempered softmax."""
        if isinstance(logits, HeadInput):
            sps = chunked_head_sum_pi_squared(logits.hidden[0], logits.weight, self.model.ps.tp_group,
                                              temperature=self.temperature, vocab_size=self.model.dims.vocab_size,
                                              chunk_tokens=self.head_chunk)
            return _placed(sps, mb, mb["response_mask"].shape[1])
        sps = vocab_parallel_sum_pi_squared(self._scaled(logits), self.model.ps.tp_group)
        return _placed(sps[0], mb, mb["response_mask"].shape[1])

    def update(self, exp: Experience, *, mini_batch_size: int, epochs: int, loss_mode: str, loss_knobs: dict,
               loss_agg_mode: str, entropy_coeff: float, use_kl_loss: bool, kl_loss_coef: float, kl_loss_type: str,
               seed: int, loss_scale_factor: float | None = None) -> dict[str, float]:
        """PPO epochs over mini-batches (sequences), one optimizer step per mini-batch. The policy loss is
        `POLICY_LOSSES[loss_mode]` (megappo.ppo.policy_losses) given the `loss_knobs` it takes."""
        assert self.trainable is not None, "the reference model is not trained"
        first_micro_batch = [True]
        parts = itertools.count()  # clip_cov draws its tokens from a generator seeded per micro-batch part
        knobs_of = (lambda rows: {"rollout_is_batch_mean": self._is_batch_mean(exp, rows, loss_knobs)}) \
            if loss_mode == "bypass_mode" and weights_need_batch_mean(**loss_knobs) else None

        def loss_for(counts, **mini_batch_knobs):
            def on_output(logits, mb):
                lp, ent = self._token_stats(logits, mb, entropy=True)  # logged always
                mask = mb["response_mask"]
                inputs = ppo_losses.LossInputs(mb["old"], lp, mb["adv"], mask, loss_agg_mode=loss_agg_mode,
                                               rollout_is_weights=mb.get("isw"), **counts)
                pg_loss, m = compute_policy_loss(
                    loss_mode, inputs, generator=torch.Generator().manual_seed(seed * 100_003 + next(parts)),
                    **loss_knobs, **mini_batch_knobs)
                loss = pg_loss
                ent_loss = ppo_losses.agg_loss(ent, mask, loss_agg_mode, **counts)
                if entropy_coeff:
                    loss = loss - entropy_coeff * ent_loss
                if use_kl_loss:
                    kl = kl_penalty(lp, mb["ref"], kl_loss_type)
                    kl_loss = ppo_losses.agg_loss(kl, mask, loss_agg_mode, **counts)
                    loss = loss + kl_loss_coef * kl_loss
                    m["actor/kl_loss"] = kl_loss.detach()
                if first_micro_batch[0]:
                    # before any update: 0 when old log-probs were recomputed by this model
                    first_micro_batch[0] = False
                    m["actor/ppo_kl_first_micro_batch"] = masked_mean(mb["old"] - lp.detach(), mask)
                m["actor/pg_loss"] = pg_loss.detach()
                m["actor/entropy"] = ent_loss.detach()
                # device scalars, read after the step (_ppo_updates): no synchronization per micro-batch
                return loss, {k: v.detach() if torch.is_tensor(v) else v for k, v in m.items()}

            return on_output

        extra = {"old": exp.old_log_probs, "adv": exp.advantages, "ref": exp.ref_log_probs,
                 "isw": exp.rollout_is_weights}
        with RouterStats(self.model) as routers:  # MoE: load balance of the update's routing
            out = _ppo_updates(self, exp, extra, loss_for, prefix="actor", mini_batch_size=mini_batch_size,
                               epochs=epochs, seed=seed, knobs_of=knobs_of, loss_scale_factor=loss_scale_factor)
        moe = routers.metrics("actor")  # collective
        return {**out, **moe} if out else out

    @torch.no_grad()
    def _is_batch_mean(self, exp: Experience, rows: torch.Tensor, knobs: dict) -> float:
        """Bypass mode's batch normalisation: the mean IS weight (current policy / the engine's) of the
        mini-batch `rows`, from a forward pass of the policy that its update starts from; the same on every
        rank (one all-reduce of the parts' sums; megappo.ppo.rollout_correction.is_weight_sums)."""
        mbs = self._split(exp.seqs, rows, "response", {"old": exp.old_log_probs})

        def on_output(logits, mb):
            lp, _ = self._token_stats(logits, mb, entropy=False)
            zero = (logits.hidden if isinstance(logits, HeadInput) else logits).new_zeros(())  # no loss
            return zero, is_weight_sums(lp, mb["old"], mb["response_mask"], rollout_is=knobs["rollout_is"],
                                        rollout_is_threshold=knobs["rollout_is_threshold"])

        results = run_micro_batches(self.model, mbs, on_output, forward_only=True, routing=self.routing,
                                    head_input=self.head_chunk > 0)
        ps = self.model.ps
        sums = torch.zeros(2, dtype=torch.float64)
        if results and ps.tp_rank == 0 and ps.cp_rank == 0:  # the last stage's results, once per TP x CP group
            sums = torch.stack(results).sum(0).cpu()
        sums = sums.to(ps.device)
        dist.all_reduce(sums)
        return float(sums[0] / sums[1]) if sums[1] > 0 else 1.0


class ValueWorker(_Passes):
    """Critic (trainable) or reward model (frozen): [N, R] values / [N] scores."""

    def __init__(self, model: MegatronModel, *, batching: MicroBatching, trainable: Trainable | None = None):
        self.model, self.trainable, self.batching, self.counter = model, trainable, batching, PassCounter()
        self.flops = {}

    @torch.no_grad()
    def values(self, seqs: SeqBatch) -> torch.Tensor | None:
        """[N, R]: the value of the state before each response token (verl), on rank 0."""
        mbs = self._split(seqs, None, "response", {})
        width = seqs.response_mask.shape[1]
        results = run_micro_batches(
            self.model, mbs,
            lambda v, mb: (v.new_zeros(()), _placed(v[0].float(), mb, width) * mb["response_mask"]),
            forward_only=True)
        return self._gather(mbs, results, seqs.size)

    @torch.no_grad()
    def scores(self, seqs: SeqBatch) -> torch.Tensor | None:
        """[N] reward-model score: the value at each sequence's last response token, on rank 0."""
        mbs = self._split(seqs, None, "last", {})
        results = run_micro_batches(self.model, mbs, lambda v, mb: (v.new_zeros(()), _placed(v[0].float(), mb, 1)[:, 0]),
                                    forward_only=True)
        return self._gather(mbs, results, seqs.size)

    def update(self, exp: Experience, *, mini_batch_size: int, epochs: int, cliprange_value: float,
               loss_agg_mode: str, seed: int, loss_scale_factor: float | None = None) -> dict[str, float]:
        assert self.trainable is not None, "the reward model is not trained"

        def loss_for(counts):
            def on_output(v, mb):
                vpreds = _placed(v[0].float(), mb, mb["response_mask"].shape[1])
                loss, clipfrac = ppo_losses.value_loss(
                    vpreds=vpreds, returns=mb["returns"], values=mb["values"], response_mask=mb["response_mask"],
                    cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode, **counts)
                return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac.detach()}

            return on_output

        return _ppo_updates(self, exp, {"values": exp.values, "returns": exp.returns}, loss_for, prefix="critic",
                            mini_batch_size=mini_batch_size, epochs=epochs, seed=seed,
                            loss_scale_factor=loss_scale_factor)


def _ppo_updates(worker: _Passes, exp: Experience, extra: dict, loss_for, *, prefix: str,
                 mini_batch_size: int, epochs: int, seed: int, knobs_of=None,
                 loss_scale_factor: float | None = None) -> dict[str, float]:
    """`epochs` passes over shuffled mini-batches (sequences), one optimizer step each, then one
    step of the LR schedule (as verl: the rate is constant over a training step's mini-batches and
    epochs, and `optim.warmup_steps` counts training steps). Every
    mini-batch's loss function is built by `loss_for(counts)` with that mini-batch's global
    token/sequence counts, so each DP replica and micro-batch computes its exact share;
    `knobs_of(rows)` (a collective), when given, adds loss knobs of the mini-batch's own.
    seq-mean-token-sum-norm divides by `loss_scale_factor`, or without one by the step's longest
    response (the batch's response width, the same in every part)."""
    trainable = worker.trainable
    model = trainable.model
    metrics: dict[str, list[float]] = {}
    for epoch in range(epochs):
        for rows in _mini_batches(exp.seqs.size, mini_batch_size, model.ps.dp, seed + epoch):
            counts = ppo_losses.global_counts(exp.seqs.response_mask[rows])
            if loss_scale_factor is not None:
                counts["loss_scale_factor"] = loss_scale_factor
            knobs = knobs_of(rows) if knobs_of else {}
            mbs = worker._split(exp.seqs, rows, "response", extra, training=True)
            results, step = train_step(trainable, mbs, loss_for(counts, **knobs), routing=worker.routing,
                                       head_input=worker.head_chunk > 0, step_scheduler=False)
            for r in results:  # parts of global-count losses (device scalars, read once the step is done)
                for k, v in r.items():
                    metrics.setdefault(k, []).append(float(v))
            for key, name in (("grad_norm", "grad_norm"), ("lr", "lr"), ("skipped", "skipped_steps")):
                metrics.setdefault(f"{prefix}/{name}", []).append(step[key])
    trainable.scheduler.step(increment=1)
    return _reduce_metrics(model, metrics)


def _mini_batches(n: int, size: int, dp: int, seed: int) -> list[torch.Tensor]:
    """Shuffled row indices, split into mini-batches of `size` sequences (n % size == 0)."""
    if n % size or size % dp:
        raise ValueError(f"{n} sequences do not split into mini-batches of {size} over dp={dp}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [order[i:i + size] for i in range(0, n, size)]


_PER_STEP = ("grad_norm", "/lr", "skipped_steps")
#: metrics a loss computes over its own part (bypass mode's rollout_corr/*), not parts of a global mean
_PER_PART = ("rollout_corr/",)


def _reduce_metrics(model: MegatronModel, metrics: dict[str, list[float]]) -> dict[str, float]:
    """On rank 0: per-optimizer-step values averaged over the steps. Loss metrics come from
    global-count losses, so the parts of one mini-batch (micro-batches x DP replicas) add
    up to its value: their grand total is divided by the number of optimizer steps."""
    parts = gather_to_rank0(model.ps, metrics)
    if parts is None:
        return {}
    steps = max(len(v) for k, v in parts[0].items() if k.endswith("grad_norm"))
    out = {}
    for key, first in parts[0].items():
        if key.endswith(_PER_STEP):
            out[key] = sum(first) / len(first)
        elif key.endswith("first_micro_batch"):
            out[key] = first[0]  # DP replica 0's first micro-batch
        elif key.startswith(_PER_PART):  # each part's own statistic (verl averages them over micro-batches)
            values = [v for p in parts for v in p.get(key, ())]
            out[key] = sum(values) / len(values)
        else:
            out[key] = sum(sum(p.get(key, ())) for p in parts) / steps
    return out
