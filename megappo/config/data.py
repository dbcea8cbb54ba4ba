"""Prompts: `data` (files or a generated dataset, prompt length, batch sizes, chat template,
system prompt and few-shot turns), a dataset class of the user's (`data.custom_cls`) and a sampler
class of the user's (`data.sampler`).

Cross-section rule beside these sections: `require_training_data`, what `megappo train` needs
beyond a valid config (prompts, a reward, validation prompts when validation is asked for), which
reads the root `Config` (megappo.config.root, which imports this module).

Owns: these sections, their defaults and checks. Does not read any data: megappo.data.prompts and
megappo.trainer.data_check do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from megappo.config.schema import _at_least, _default, _require, _Section
from megappo.errors import P


#: apply_chat_template's arguments megappo sets in each rendering (data.apply_chat_template_kwargs may not)
TEMPLATE_ARGUMENTS_SET_BY_MEGAPPO = ("conversation", "messages", "add_generation_prompt", "tokenize", "return_dict",
                                     "return_tensors", "continue_final_message")


@dataclasses.dataclass(frozen=True)
class CustomClsConfig(_Section):
    """A dataset class of the user's that turns data files into rows (verl's data.custom_cls): megappo.data.prompts.class_rows."""

    path: Optional[str] = None
    """A `.py` file or an importable module."""
    name: Optional[str] = None
    """The class in it."""

    def check(self) -> None:
        _require((self.path is None) == (self.name is None),
                 f"{P}path={self.path} and {P}name={self.name}: a dataset class needs both. Fix: set both (the file "
                 f"and the class in it), or neither.")


@dataclasses.dataclass(frozen=True)
class SamplerConfig(_Section):
    """A sampler class of the user's that orders the prompts each epoch (verl's data.sampler): megappo.data.prompts.ClassOrder."""

    class_path: Optional[str] = None
    """A `.py` file or an importable module."""
    class_name: Optional[str] = None
    """The class in it."""

    def check(self) -> None:
        _require((self.class_path is None) == (self.class_name is None),
                 f"{P}class_path={self.class_path} and {P}class_name={self.class_name}: a sampler class needs both. "
                 f"Fix: set both (the file and the class in it), or neither.")


@dataclasses.dataclass(frozen=True)
class DataConfig(_Section):
    train_files: list[str] = dataclasses.field(default_factory=list)
    """JSONL/Parquet files in verl's layout (`prompt`, `reward_model.ground_truth`, ...)."""
    val_files: list[str] = dataclasses.field(default_factory=list)
    """Validation files."""
    builtin: Optional[str] = None
    """A generated dataset instead of files: `digit_successor`, `lookup`, `code_expression`,
    `reasoning_gym:<task>`. Not together with `train_files`."""
    builtin_size: int = 2048
    """Prompts generated for training (>= `train_batch_size`)."""
    builtin_val_size: int = 64
    """Validation prompts generated when `val_files` is empty, none a training prompt (`digit_successor`,
    `lookup` and `code_expression` excepted: their 10 prompts are all in training)."""
    builtin_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Generator options, e.g. `{max_terms: 2, max_digits: 1}` for reasoning-gym's `basic_arithmetic`."""
    prompt_key: str = "prompt"
    """Column holding the prompt (chat messages or text)."""
    max_prompt_length: int = 512
    """In tokens."""
    long_prompt_policy: Literal["skip", "truncate", "error"] = "skip"
    """Longer prompts are skipped (`skip`), cut from the left (`truncate`), or an error (`error`)."""
    bad_row_policy: Literal["error", "warn", "skip"] = "error"
    """The start-up data check: rows without a prompt, with characters the tokenizer lacks, or without a field a
    reward function reads. `error`: stop with counts, examples and the fix; `warn`: train on them (prompt-less rows
    dropped); `skip`: drop them ([own-data.md](own-data.md#when-the-data-is-wrong))."""
    train_batch_size: int = 1024
    """Prompts per PPO step."""
    gen_batch_size: Optional[int] = None
    """With `algorithm.filter_groups`: prompts per generation batch ([dapo.md](dapo.md#dynamic-sampling)); `null`:
    `train_batch_size`."""
    shuffle: bool = True
    """Reshuffle prompts every epoch."""
    seed: int = 1
    """Shuffling / generation seed."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """More arguments of the chat template in every rendering (the prompts and the turns of multi-turn episodes),
    e.g. `{enable_thinking: false}` for Qwen3 (verl's key)."""
    system_prompt: Optional[str] = None
    """A system message for every prompt without one (replaces the template's default; [tools.md](tools.md))."""
    few_shot: list[dict[str, str]] = dataclasses.field(default_factory=list)
    """Example turns after the system message of every prompt, e.g. a question, the assistant's tool call, the
    tool's answer and the final answer: `[{role: user, content: ...}, {role: assistant, content: ...}, ...]`,
    starting with a user turn ([tools.md](tools.md))."""
    custom_cls: CustomClsConfig = _default(CustomClsConfig)
    """A dataset class of yours that reads `train_files` / `val_files` into rows in verl's layout (verl's keys):
    `Class(data_files, config)`, read with `len()` and `[i]` or by iterating
    ([own-data.md](own-data.md#1-the-dataset)). Not with `builtin`."""
    sampler: SamplerConfig = _default(SamplerConfig)
    """A sampler class of yours that orders the training prompts each epoch instead of `shuffle` (verl's keys):
    `Class(data_source, data_config)`, iterated once per epoch for N indices in [0, N); a resumed run replays its
    epochs. A curriculum sampler (verl's `update(batch)`) is refused."""

    def check(self) -> None:
        _require(not (self.custom_cls.path and self.builtin),
                 f"{P}custom_cls reads data.train_files, but {P}builtin={self.builtin} generates the rows. Fix: set "
                 f"{P}builtin=null, or remove {P}custom_cls.")
        _at_least(self, builtin_size=1, builtin_val_size=1, max_prompt_length=1, train_batch_size=1, gen_batch_size=1)
        _require(not (self.builtin and self.train_files),
                 f"{P}builtin and {P}train_files are both set. Fix: set {P}builtin=null or {P}train_files=[].")
        _require(not self.builtin or self.builtin_size >= self.train_batch_size,
                 f"{P}builtin_size={self.builtin_size} is smaller than {P}train_batch_size={self.train_batch_size}: "
                 f"not one full step. Fix: raise {P}builtin_size or lower {P}train_batch_size.")
        for i, m in enumerate(self.few_shot):
            _require(set(m) == {"role", "content"} and m["role"] in ("user", "assistant", "tool"),
                     f"{P}few_shot[{i}]={m} is not a chat message. Fix: write {{role: user, content: ...}} "
                     "(role user, assistant or tool; the system message is data.system_prompt).")
        _require(not self.apply_chat_template_kwargs or self.apply_chat_template,
                 f"{P}apply_chat_template_kwargs={self.apply_chat_template_kwargs} are the chat template's, but "
                 f"{P}apply_chat_template=false renders no template. Fix: set {P}apply_chat_template=true or "
                 f"{P}apply_chat_template_kwargs={{}}.")
        reserved = sorted(set(self.apply_chat_template_kwargs) & set(TEMPLATE_ARGUMENTS_SET_BY_MEGAPPO))
        _require(not reserved, f"{P}apply_chat_template_kwargs sets {reserved}, which megappo sets itself in each "
                               f"rendering. Fix: remove them (the template's own variables, such as enable_thinking, "
                               f"go there).")
        _require(not self.few_shot or self.few_shot[0]["role"] == "user",
                 f"{P}few_shot starts with a turn of role "
                 f"'{self.few_shot[0]['role'] if self.few_shot else ''}'. Fix: start it with the example's question, "
                 "a user turn.")

    def require_training_data(self) -> None:
        """Training needs prompts; a conversion-only config does not (so this is not in check())."""
        _require(bool(self.train_files or self.builtin), "data.train_files and data.builtin are both empty. Fix: "
                 "set data.train_files=[train.jsonl] or data.builtin=<name> to train.")


# -- rules across sections ----------------------------------------------------------------------

def require_training_data(cfg: "Config") -> None:
    """What `megappo train` needs beyond a valid config: prompts, a reward, validation prompts if asked for."""
    cfg.data.require_training_data()
    _require(bool(cfg.reward.functions or cfg.reward.model_path or cfg.rollout.env != "single_turn"),
             "no reward: reward.functions is empty, reward.model_path is unset and rollout.env=single_turn. Fix: "
             "set reward.functions=[gsm8k] (names in megappo.rewards), reward.model_path, or a rollout.env whose "
             "steps give rewards.")
    wants_val = cfg.run.val_every > 0 or cfg.run.val_before_train
    _require(not wants_val or bool(cfg.data.val_files or cfg.data.builtin),
             "run.val_every / run.val_before_train ask for validation, but data.val_files is empty. Fix: set "
             "data.val_files=[val.jsonl] or run.val_every=0 run.val_before_train=false.")
    _require(not cfg.run.val_only or bool(cfg.data.val_files or cfg.data.builtin),
             "run.val_only=true validates, but data.val_files is empty. Fix: set data.val_files=[val.jsonl].")
