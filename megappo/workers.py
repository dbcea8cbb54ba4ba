"""The four PPO roles on Megatron models: actor, reference, critic, reward model.

Every method is a collective over all ranks (SPMD). Inputs are global batches that every
rank holds (broadcast by the orchestrator); each DP replica takes its shard, runs it in
micro-batches through the pipeline schedule (`megappo.models.forward` /
`megappo.models.training`), and per-sample results come back to global rank 0 in batch
order. Log-probs and entropy are computed from TP-sharded logits without gathering the
vocabulary (`megappo.parallel.vocab_parallel`).

Shape legend: N samples in the global batch, n = N / dp on a replica, b micro-batch,
P prompt length, R response length, T = P + R, V_pad/tp vocab shard.

This module does not know about the rollout engine, rewards or the step's order.
"""

from __future__ import annotations

import dataclasses

import torch

from megappo.models.builders import MegatronModel
from megappo.models.forward import run_micro_batches
from megappo.models.training import Trainable, train_step
from megappo.parallel.comm import dp_shard, gather_to_rank0
from megappo.parallel.vocab_parallel import vocab_parallel_log_probs, vocab_parallel_log_probs_and_entropy
from megappo.ppo import losses as ppo_losses
from megappo.ppo.kl import kl_penalty
from megappo.ppo.stats import masked_mean


@dataclasses.dataclass
class SeqBatch:
    """What every role reads: prompt + response tokens, [N, T] and the response part."""

    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, R]
    prompt_len: int

    @property
    def response_ids(self) -> torch.Tensor:  # [N, R]
        return self.input_ids[:, self.prompt_len:]

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


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


def _micro_batches(seqs: SeqBatch, rows: slice | torch.Tensor, mb: int, extra: dict[str, torch.Tensor | None]
                   ) -> list[dict[str, torch.Tensor]]:
    ids, attn, resp = seqs.input_ids[rows], seqs.attention_mask[rows], seqs.response_mask[rows]
    n = ids.shape[0]
    if n % mb:
        raise ValueError(f"{n} sequences per replica do not split into micro-batches of {mb}; "
                         "choose a micro_batch_size that divides the per-replica batch")
    out = []
    for i in range(0, n, mb):
        d = {"input_ids": ids[i:i + mb], "attention_mask": attn[i:i + mb], "response_mask": resp[i:i + mb]}
        d.update({k: v[rows][i:i + mb] for k, v in extra.items() if v is not None})
        out.append(d)
    return out


def _gather_rows(model: MegatronModel, results: list[torch.Tensor]) -> torch.Tensor | None:
    """Rows of every DP replica, on rank 0's host (the orchestrator works on CPU tensors)."""
    local = torch.cat(results).cpu() if results else None
    parts = gather_to_rank0(model.ps, local)
    return torch.cat(parts) if parts is not None else None


class PolicyWorker:
    """Actor (trainable) or reference (frozen): log-probs of response tokens, and updates."""

    def __init__(self, model: MegatronModel, *, micro_batch_size: int, temperature: float = 1.0,
                 trainable: Trainable | None = None):
        self.model, self.trainable = model, trainable
        self.micro_batch_size, self.temperature = micro_batch_size, temperature
        ps = model.ps
        per_tp = model.padded_vocab // ps.tp
        vocab_ids = torch.arange(ps.tp_rank * per_tp, (ps.tp_rank + 1) * per_tp, device=ps.device)
        self._padded_vocab = vocab_ids >= model.dims.vocab_size  # [V_pad/tp] True for padding rows
        self._has_padding = bool(self._padded_vocab.any())

    def _response_logits(self, logits: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """[b, T, V_pad/tp] -> [b, R, V_pad/tp] scaled by 1/temperature, padding rows masked.
        Each step is skipped where it would not change a bit (temperature 1, a shard without
        padding rows): each is a pass over the logits, and another in the backward. bf16
        logits stay bf16 unless scaled: the log-prob function reads them in float32 block by
        block, and keeps them, not a float32 copy, for its backward."""
        logits = logits[:, prompt_len - 1:-1]
        if self.temperature != 1.0:
            logits = logits.float() / self.temperature
        if self._has_padding:
            logits = logits.masked_fill(self._padded_vocab, float("-inf"))
        return logits

    def _token_stats(self, logits: torch.Tensor, mb: dict, prompt_len: int, entropy: bool):
        logits = self._response_logits(logits, prompt_len)
        labels = mb["input_ids"][:, prompt_len:]
        if entropy:  # one pass over the shard for both
            return vocab_parallel_log_probs_and_entropy(logits, labels, self.model.ps.tp_group)
        return vocab_parallel_log_probs(logits, labels, self.model.ps.tp_group), None

    @torch.no_grad()
    def log_probs(self, seqs: SeqBatch, *, with_entropy: bool = False):
        """[N, R] log-probs (and [N, R] entropy) on rank 0; None elsewhere."""
        rows = dp_shard(seqs.size, self.model.ps)
        mbs = _micro_batches(seqs, rows, self.micro_batch_size, {})

        def on_output(logits, mb):
            lp, ent = self._token_stats(logits, mb, seqs.prompt_len, with_entropy)
            out = torch.stack([lp, ent]) if with_entropy else lp[None]
            return logits.new_zeros(()), out * mb["response_mask"]

        results = run_micro_batches(self.model, mbs, on_output, forward_only=True)
        stacked = _gather_rows(self.model, [r.transpose(0, 1) for r in results])
        if stacked is None:
            return (None, None) if with_entropy else None
        return (stacked[:, 0], stacked[:, 1]) if with_entropy else stacked[:, 0]

    def update(self, exp: Experience, *, mini_batch_size: int, epochs: int, clip_ratio_low: float,
               clip_ratio_high: float, clip_ratio_c: float, loss_agg_mode: str, entropy_coeff: float,
               use_kl_loss: bool, kl_loss_coef: float, kl_loss_type: str, seed: int) -> dict[str, float]:
        """PPO epochs over mini-batches (sequences), one optimizer step per mini-batch."""
        assert self.trainable is not None, "the reference model is not trained"
        first_micro_batch = [True]

        def loss_for(counts):
            def on_output(logits, mb):
                lp, ent = self._token_stats(logits, mb, exp.seqs.prompt_len, entropy=True)  # logged always
                mask = mb["response_mask"]
                pg_loss, m = ppo_losses.policy_loss(
                    old_log_prob=mb["old"], log_prob=lp, advantages=mb["adv"], response_mask=mask,
                    clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                    loss_agg_mode=loss_agg_mode, rollout_is_weights=mb.get("isw"), **counts)
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
                return loss, {k: float(v) for k, v in m.items()}

            return on_output

        extra = {"old": exp.old_log_probs, "adv": exp.advantages, "ref": exp.ref_log_probs,
                 "isw": exp.rollout_is_weights}
        return _ppo_updates(self.trainable, exp, extra, loss_for, prefix="actor", micro_batch_size=self.micro_batch_size,
                            mini_batch_size=mini_batch_size, epochs=epochs, seed=seed)


class ValueWorker:
    """Critic (trainable) or reward model (frozen): [N, R] values / [N] scores."""

    def __init__(self, model: MegatronModel, *, micro_batch_size: int, trainable: Trainable | None = None):
        self.model, self.trainable, self.micro_batch_size = model, trainable, micro_batch_size

    @staticmethod
    def _response_values(values: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """[b, T] -> [b, R]: the value of the state before each response token (verl)."""
        return values[:, prompt_len - 1:-1]

    @torch.no_grad()
    def values(self, seqs: SeqBatch) -> torch.Tensor | None:
        rows = dp_shard(seqs.size, self.model.ps)
        mbs = _micro_batches(seqs, rows, self.micro_batch_size, {})
        results = run_micro_batches(
            self.model, mbs,
            lambda v, mb: (v.new_zeros(()), self._response_values(v.float(), seqs.prompt_len) * mb["response_mask"]),
            forward_only=True)
        return _gather_rows(self.model, results)

    @torch.no_grad()
    def scores(self, seqs: SeqBatch) -> torch.Tensor | None:
        """[N] reward-model score: the value at each sequence's last response token."""
        rows = dp_shard(seqs.size, self.model.ps)
        mbs = _micro_batches(seqs, rows, self.micro_batch_size, {})

        def on_output(v, mb):
            last = seqs.prompt_len + (mb["response_mask"].sum(-1) - 1).clamp(min=0)  # [b] in the full sequence
            return v.new_zeros(()), v.float().gather(1, last[:, None]).squeeze(1)

        return _gather_rows(self.model, run_micro_batches(self.model, mbs, on_output, forward_only=True))

    def update(self, exp: Experience, *, mini_batch_size: int, epochs: int, cliprange_value: float,
               loss_agg_mode: str, seed: int) -> dict[str, float]:
        assert self.trainable is not None, "the reward model is not trained"

        def loss_for(counts):
            def on_output(v, mb):
                vpreds = self._response_values(v.float(), exp.seqs.prompt_len)
                loss, clipfrac = ppo_losses.value_loss(
                    vpreds=vpreds, returns=mb["returns"], values=mb["values"], response_mask=mb["response_mask"],
                    cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode, **counts)
                return loss, {"critic/vf_loss": loss.item(), "critic/vf_clipfrac": clipfrac.item()}

            return on_output

        return _ppo_updates(self.trainable, exp, {"values": exp.values, "returns": exp.returns}, loss_for,
                            prefix="critic", micro_batch_size=self.micro_batch_size,
                            mini_batch_size=mini_batch_size, epochs=epochs, seed=seed)


def _ppo_updates(trainable: Trainable, exp: Experience, extra: dict, loss_for, *, prefix: str,
                 micro_batch_size: int, mini_batch_size: int, epochs: int, seed: int) -> dict[str, float]:
    """`epochs` passes over shuffled mini-batches (sequences), one optimizer step each. Every
    mini-batch's loss function is built by `loss_for(counts)` with that mini-batch's global
    token/sequence counts, so each DP replica and micro-batch computes its exact share."""
    model = trainable.model
    metrics: dict[str, list[float]] = {}
    for epoch in range(epochs):
        for rows in _mini_batches(exp.seqs.size, mini_batch_size, model.ps.dp, seed + epoch):
            counts = ppo_losses.global_counts(exp.seqs.response_mask[rows])
            mbs = _micro_batches(exp.seqs, rows[dp_shard(len(rows), model.ps)], micro_batch_size, extra)
            results, step = train_step(trainable, mbs, loss_for(counts))
            for r in results:  # parts of global-count losses: summed in _reduce_metrics
                for k, v in r.items():
                    metrics.setdefault(k, []).append(v)
            for key, name in (("grad_norm", "grad_norm"), ("lr", "lr"), ("skipped", "skipped_steps")):
                metrics.setdefault(f"{prefix}/{name}", []).append(step[key])
    return _reduce_metrics(model, metrics)


def _mini_batches(n: int, size: int, dp: int, seed: int) -> list[torch.Tensor]:
    """Shuffled row indices, split into mini-batches of `size` sequences (n % size == 0)."""
    if n % size or size % dp:
        raise ValueError(f"{n} sequences do not split into mini-batches of {size} over dp={dp}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [order[i:i + size] for i in range(0, n, size)]


_PER_STEP = ("grad_norm", "/lr", "skipped_steps")


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
        else:
            out[key] = sum(sum(p.get(key, ())) for p in parts) / steps
    return out
