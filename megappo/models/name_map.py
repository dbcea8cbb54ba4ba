"""Megatron <-> HF parameter names and transforms, per architecture (pure: torch only).

One `TensorRule` per Megatron parameter says which HF tensors it comes from and how:
QKV fused and interleaved per query group, gate/up fused into fc1 (per expert for MoE maps,
`MoENameMap`, with global expert numbers and HF checkpoint names), vocab rows padded to a
TP-divisible size, tied embeddings, and the value head of critic/reward models. Rules
speak of *full* Megatron tensors (what a TP=1 model holds) with *global* layer numbers;
`shard_for_tp` / `merge_tp_shards` move between a full tensor and its TP shards.

The conversion tools, the HF weight loader and the weight-sync bridge all use this map,
so HF -> Megatron -> HF round-trips bit-exactly. Maps are chosen from `NAME_MAPS` by the
HF architecture name, never by substring matching.

Megatron names (local layer spec; the TE spec's fused-norm names are accepted as aliases):
  embedding.word_embeddings.weight                    [V_pad, H]      TP dim 0
  decoder.layers.{i}.input_layernorm.weight           [H]
  decoder.layers.{i}.self_attention.linear_qkv.weight [(nq+2g)*d, H]  TP dim 0
  decoder.layers.{i}.self_attention.linear_qkv.bias   [(nq+2g)*d]     TP dim 0 (qwen2)
  decoder.layers.{i}.self_attention.linear_proj.weight [H, nq*d]      TP dim 1
  decoder.layers.{i}.self_attention.{q,k}_layernorm.weight [d]        (qwen3)
  decoder.layers.{i}.pre_mlp_layernorm.weight         [H]
  decoder.layers.{i}.mlp.linear_fc1.weight            [2*F, H]        TP dim 0, gate|up per shard
  decoder.layers.{i}.mlp.linear_fc2.weight            [H, F]          TP dim 1
  decoder.final_layernorm.weight                      [H]
  output_layer.weight                                 [V_pad, H]  (LM)  or [1, H] (value head)
  output_layer.bias                                   [1]             (value head, optional)
Legend: V_pad padded vocab, H hidden, nq heads, g query groups, d head dim, F ffn size.

This module does not know about process groups, files or engines.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import torch

from megappo.models.hf_config import ModelDims, ModelConfigError

#: TE layer-spec names -> local-spec names (the TE spec fuses norms into the next linear).
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """How one full Megatron tensor relates to HF tensors."""

    megatron: str
    hf: tuple[str, ...]
    to_hf: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    from_hf: Callable[..., torch.Tensor]
    tp_dim: int | None = None  # None: replicated across TP
    glu: bool = False  # fc1: each TP shard is [gate_k; up_k]
    #: HF name this tensor is exported as; False for a duplicate (tied output layer)
    export: bool = True
    #: a routed expert's tensor: split over the expert-parallel group as well as TP
    expert: bool = False


def _identity(t: torch.Tensor) -> tuple[torch.Tensor]:
    return (t,)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class NameMap:
    """The rules for one model: architecture + dims + (LM head | value head)."""

    def __init__(self, dims: ModelDims, *, padded_vocab: int, value_head: bool = False,
                 value_head_bias: bool = False):
        self.dims = dims
        self.padded_vocab = padded_vocab
        self.value_head = value_head
        self.value_head_bias = value_head_bias
        self._rules = {rule.megatron: rule for rule in self._build()}

    # -- rules -------------------------------------------------------------------------

    def _vocab_rule(self, megatron: str, hf: str, export: bool = True) -> TensorRule:
        vocab, padded = self.dims.vocab_size, self.padded_vocab

        def to_hf(t):
            return (t[:vocab],)

        def from_hf(t):
            if t.shape[0] != vocab:
                raise ModelConfigError(
                    f"{hf} has {t.shape[0]} rows but the config's vocab_size is {vocab}."
                )
            out = t.new_zeros((padded,) + tuple(t.shape[1:]))
            out[:vocab] = t
            return out

        return TensorRule(megatron, (hf,), to_hf, from_hf, tp_dim=0, export=export)

    def _qkv_rule(self, megatron: str, prefix: str, suffix: str) -> TensorRule:
        d = self.dims
        q_per_group = d.num_heads // d.num_query_groups
        g, hd = d.num_query_groups, d.head_dim

        def to_hf(t):
            rest = tuple(t.shape[1:])
            grouped = t.reshape((g, (q_per_group + 2) * hd) + rest)
            q, k, v = torch.split(grouped, [q_per_group * hd, hd, hd], dim=1)
            return tuple(x.reshape((-1,) + rest).contiguous() for x in (q, k, v))

        def from_hf(q, k, v):
            rest = tuple(q.shape[1:])
            parts = (q.reshape((g, q_per_group * hd) + rest), k.reshape((g, hd) + rest),
                     v.reshape((g, hd) + rest))
            return torch.cat(parts, dim=1).reshape((-1,) + rest).contiguous()

        hf = tuple(f"{prefix}.self_attn.{p}_proj.{suffix}" for p in "qkv")
        return TensorRule(megatron, hf, to_hf, from_hf, tp_dim=0)

    def _fc1_rule(self, megatron: str, prefix: str) -> TensorRule:
        def to_hf(t):
            gate, up = torch.chunk(t, 2, dim=0)
            return gate.contiguous(), up.contiguous()

        def from_hf(gate, up):
            return torch.cat([gate, up], dim=0)

        hf = (f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight")
        return TensorRule(megatron, hf, to_hf, from_hf, tp_dim=0, glu=True)

    def _mlp_rules(self, layer: int, m: str, h: str) -> Iterable[TensorRule]:
        """A dense SwiGLU MLP (MoE maps override this for their expert layers)."""
        yield self._fc1_rule(f"{m}.mlp.linear_fc1.weight", h)
        yield TensorRule(f"{m}.mlp.linear_fc2.weight", (f"{h}.mlp.down_proj.weight",), _identity, _same, tp_dim=1)

    def _build(self) -> Iterable[TensorRule]:
        d = self.dims
        yield self._vocab_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight")
        for i in range(d.num_layers):
            m, h = f"decoder.layers.{i}", f"model.layers.{i}"
            yield TensorRule(f"{m}.input_layernorm.weight", (f"{h}.input_layernorm.weight",), _identity, _same)
            yield self._qkv_rule(f"{m}.self_attention.linear_qkv.weight", h, "weight")
            if d.qkv_bias:
                yield self._qkv_rule(f"{m}.self_attention.linear_qkv.bias", h, "bias")
            yield TensorRule(f"{m}.self_attention.linear_proj.weight", (f"{h}.self_attn.o_proj.weight",),
                             _identity, _same, tp_dim=1)
            if d.qk_layernorm:  # [d] each, replicated across TP
                for meg, hf in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                    yield TensorRule(f"{m}.self_attention.{meg}.weight", (f"{h}.self_attn.{hf}.weight",),
                                     _identity, _same)
            yield TensorRule(f"{m}.pre_mlp_layernorm.weight", (f"{h}.post_attention_layernorm.weight",),
                             _identity, _same)
            yield from self._mlp_rules(i, m, h)
        yield TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",), _identity, _same)
        if self.value_head:
            yield TensorRule("output_layer.weight", ("score.weight",), _identity, _same)
            if self.value_head_bias:
                yield TensorRule("output_layer.bias", ("score.bias",), _identity, _same)
        elif d.tie_word_embeddings:
            # Only a PP>1 last stage holds this copy of the embedding; never exported.
            yield self._vocab_rule("output_layer.weight", "model.embed_tokens.weight", export=False)
        else:
            yield self._vocab_rule("output_layer.weight", "lm_head.weight")

    # -- lookups -----------------------------------------------------------------------

    def rules(self) -> list[TensorRule]:
        return list(self._rules.values())

    def rule(self, megatron_name: str) -> TensorRule:
        name = canonical_name(megatron_name)
        if name not in self._rules:
            raise KeyError(f"no {self.dims.arch} name-map rule for Megatron parameter '{megatron_name}'")
        return self._rules[name]

    def hf_names(self) -> list[str]:
        """Every HF tensor name this model exports, in rule order."""
        return [n for r in self._rules.values() if r.export for n in r.hf]

    # -- whole-dict conversion (tests, conversion tools) ---------------------------------

    def megatron_to_hf(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full (TP=1, global layer numbers) Megatron state -> HF state dict."""
        out = {}
        for name, tensor in full.items():
            rule = self.rule(name)
            if rule.export:
                out.update(zip(rule.hf, rule.to_hf(tensor)))
        return out

    def hf_to_megatron(self, hf: dict[str, torch.Tensor], names: Iterable[str] | None = None
                       ) -> dict[str, torch.Tensor]:
        """HF state dict -> full Megatron tensors (all rules, or just `names`)."""
        rules = self.rules() if names is None else [self.rule(n) for n in names]
        missing = sorted({n for r in rules for n in r.hf if n not in hf})
        if missing:
            raise ModelConfigError(
                f"HF weights are missing {len(missing)} tensor(s) the {self.dims.arch} map needs, "
                f"e.g. {missing[:3]}; is the checkpoint from another model?"
            )
        return {r.megatron: r.from_hf(*(hf[n] for n in r.hf)) for r in rules}


class MoENameMap(NameMap):
    """Mixture-of-experts layers: a router and per-expert SwiGLU MLPs, named per expert as HF
    checkpoints (and SGLang) name them. `EXPERT` is the HF name of expert {j}'s tensors in
    layer prefix {h} with {w} one of `PROJ` (gate, up, down); `ROUTER` the router's name.

    Megatron (SequentialMLP, global expert index j; on EP rank r the local expert k is
    global j = r * E/ep + k, see `global_param_name`):
      decoder.layers.{i}.mlp.router.weight                              [E, H]
      decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight [2*F_moe, H] TP dim 0, gate|up
      decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight [H, F_moe]   TP dim 1
    """

    ROUTER = "{h}.mlp.gate.weight"
    EXPERT = "{h}.mlp.experts.{j}.{w}.weight"
    PROJ = ("gate_proj", "up_proj", "down_proj")

    def _mlp_rules(self, layer: int, m: str, h: str) -> Iterable[TensorRule]:
        if not self.dims.moe_layer_pattern[layer]:
            yield from super()._mlp_rules(layer, m, h)
            return
        yield TensorRule(f"{m}.mlp.router.weight", (self.ROUTER.format(h=h),), _identity, _same)
        gate, up, down = self.PROJ
        for j in range(self.dims.num_experts):
            e = f"{m}.mlp.experts.local_experts.{j}"
            names = tuple(self.EXPERT.format(h=h, j=j, w=w) for w in (gate, up))
            yield dataclasses.replace(self._fc1_rule(f"{e}.linear_fc1.weight", h), hf=names, expert=True)
            yield TensorRule(f"{e}.linear_fc2.weight", (self.EXPERT.format(h=h, j=j, w=down),), _identity, _same,
                             tp_dim=1, expert=True)


class MixtralNameMap(MoENameMap):
    """Mixtral's checkpoint names: block_sparse_moe, w1 (gate), w3 (up), w2 (down)."""

    ROUTER = "{h}.block_sparse_moe.gate.weight"
    EXPERT = "{h}.block_sparse_moe.experts.{j}.{w}.weight"
    PROJ = ("w1", "w3", "w2")


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def canonical_name(name: str) -> str:
    """Strip DDP/Float16 wrappers ('module.') and map TE aliases to local-spec names."""
    while name.startswith("module."):
        name = name[len("module."):]
    for te, local in TE_ALIASES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def global_layer_name(local_name: str, layer_offset: int) -> str:
    """'decoder.layers.{i}.x' on a pipeline stage -> the same name with i + layer_offset."""
    name = canonical_name(local_name)
    match = _LAYER.match(name)
    if not match:
        return name
    return f"decoder.layers.{int(match.group(1)) + layer_offset}." + name[match.end():]


def global_param_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """`global_layer_name`, and local expert k -> global expert k + expert_offset (ep_rank * E/ep)."""
    name = global_layer_name(local_name, layer_offset)
    match = _LOCAL_EXPERT.search(name)
    if not match or not expert_offset:
        return name
    return (name[: match.start()] + f".mlp.experts.local_experts.{int(match.group(1)) + expert_offset}."
            + name[match.end():])


def shard_for_tp(full: torch.Tensor, rule: TensorRule, tp_rank: int, tp: int) -> torch.Tensor:
    """The TP shard of a full Megatron tensor held by `tp_rank`."""
    if rule.tp_dim is None or tp == 1:
        return full
    if rule.glu:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp, 0)[tp_rank], torch.chunk(up, tp, 0)[tp_rank]], 0)
    return torch.chunk(full, tp, dim=rule.tp_dim)[tp_rank].contiguous()


def merge_tp_shards(shards: list[torch.Tensor], rule: TensorRule) -> torch.Tensor:
    """Inverse of `shard_for_tp`: TP shards in rank order -> the full tensor."""
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    if rule.glu:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=rule.tp_dim)


#: HF architecture -> NameMap class. Llama and Qwen2 share the layout (Qwen2 adds the
#: qkv bias, which `ModelDims.qkv_bias` carries); a new family adds its own entry.
NAME_MAPS: dict[str, type[NameMap]] = {
    "LlamaForCausalLM": NameMap,
    "Qwen2ForCausalLM": NameMap,
    "Qwen3ForCausalLM": NameMap,  # + q/k norms, which `ModelDims.qk_layernorm` carries
    "Qwen3MoeForCausalLM": MoENameMap,
    "MixtralForCausalLM": MixtralNameMap,
}


def name_map_for(dims: ModelDims, *, padded_vocab: int, value_head: bool = False,
                 value_head_bias: bool = False) -> NameMap:
    if dims.arch not in NAME_MAPS:
        raise ModelConfigError(
            f"no name map for architecture '{dims.arch}'; registered: {sorted(NAME_MAPS)}."
        )
    return NAME_MAPS[dims.arch](dims, padded_vocab=padded_vocab, value_head=value_head,
                                value_head_bias=value_head_bias)
