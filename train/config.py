"""Schema of `hydra-heads train` (conf/train.yaml); Trainer and logger are checked `_target_`s."""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, model_validator

from train.core.base import BaseConfig
from train.core.config import ConfigModel, NonNegative, Positive, check, fail
from train.core.errors import InvalidValue
from train.decoding.tree import PRESETS
from train.heads.config import HeadConfig


def _locate(target: str) -> Any:
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise InvalidValue("_target_", target, f"an importable class or function ({e})") from None


def _arguments(obj: Any) -> set[str] | None:
    """Keyword arguments `obj(...)` accepts; None when it takes any (it has **kwargs)."""
    params = inspect.signature(obj).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def check_target(cfg: dict[str, Any], where: str = "") -> dict[str, Any]:
    """A `_target_` config whose keys are all arguments of its target (nested ones too)."""
    if "_target_" not in cfg:
        raise InvalidValue(where or "_target_", None, "a mapping with _target_ (what to build)")
    target = _locate(cfg["_target_"])
    allowed = _arguments(target)
    for key, value in cfg.items():
        if key == "_target_":
            continue
        if allowed is not None and key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise InvalidValue(
                ".".join(p for p in (where, key) if p),
                value,
                f"not an argument of {cfg['_target_']}; {hint}see its documentation",
            )
        if isinstance(value, dict) and "_target_" in value:
            check_target(value, ".".join(p for p in (where, key) if p))
    return cfg


Target = Annotated[dict[str, Any], AfterValidator(check_target)]


class TrainDataConfig(ConfigModel):
    """Where training data comes from and how it is batched (`data:` in conf/train.yaml)."""

    prepared: Annotated[str, check(bool, "the output dir of `hydra-heads prep`")]
    offline: bool  # train from cached base hidden states (prep cache_hidden=true)
    batch_size: Positive  # sequences per device per step
    val_batch_size: Annotated[int, check(lambda v: v >= 1, "a positive integer or null")] | None
    max_length: Annotated[int, check(lambda v: v >= 8, "null or an integer >= 8")] | None
    # validation's cut (null: max_length), so short training windows are scored on long contexts
    val_max_length: Annotated[int, check(lambda v: v >= 8, "null or an integer >= 8")] | None
    # which max_length window of a longer training sample: its start, or the most loss tokens
    crop: Literal["start", "supervised"]
    bucket_batches: Positive  # batches per length bucket: larger = less padding, less mixing
    shuffle: bool
    num_workers: NonNegative
    max_val_samples: (
        Annotated[int, check(lambda v: v >= 1, "null (all) or a positive integer")] | None
    )
    # train on this many samples of the prepared train split, drawn with `seed` (null: all)
    max_train_samples: (
        Annotated[int, check(lambda v: v >= 1, "null (all) or a positive integer")] | None
    )


class OptimConfig(ConfigModel):
    """AdamW over head parameters with linear warmup and cosine decay (`optim:`)."""

    lr: Annotated[float, check(lambda v: v > 0, "a learning rate > 0")]
    weight_decay: Annotated[float, check(lambda v: v >= 0, "a number >= 0")]
    betas: Annotated[
        list[float],
        check(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b), "two numbers in [0, 1)"),
    ]
    eps: float
    warmup_steps: NonNegative
    final_lr_ratio: Annotated[float, check(lambda v: 0 <= v <= 1, "a number in [0, 1]")]


class ValTauConfig(ConfigModel):
    """τ measured by real greedy tree decoding after each validation (`val_tau:`)."""

    prompts: NonNegative  # held-out first turns decoded; 0 turns the measurement off
    max_new_tokens: Positive
    max_prompt_tokens: Positive  # longer held-out prompts are passed over
    # trees to decode with; the first one's τ is `val/tau` and picks <out>/heads_best
    trees: Annotated[
        list[str],
        check(
            lambda t: bool(t) and all(n == "chain" or n in PRESETS for n in t),
            f"a non-empty list of: chain, {', '.join(PRESETS)}",
        ),
    ]


# Lightning's precision names, and auto: bf16-mixed where bf16 is fast, else 32-true
# (train/core/hardware.py, resolved and logged at start-up)
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true",
              "32", "16", "bf16", "64")  # fmt: skip


class TrainConfig(ConfigModel):
    """Everything `hydra-heads train` needs (conf/train.yaml)."""

    out: str
    base: BaseConfig
    head: HeadConfig
    data: TrainDataConfig
    optim: OptimConfig
    trainer: Target  # a lightning Trainer (conf/trainer/*.yaml)
    logger: Target | None  # a Lightning logger (conf/logger/*.yaml)
    seed: int
    # true: continue from the newest checkpoint in <out> (fails if none); auto: continue if there
    # is one, else start (what a requeued SLURM job needs); false: refuse to touch an old run
    resume: bool | Literal["auto"]
    checkpoint_every: Positive  # optimizer steps between resumable checkpoints
    keep_checkpoints: Positive
    final_validation: bool
    val_tau: ValTauConfig
    # ours: fit the step count to this many minutes of training on this machine
    # (train/time_budget.py); trainer.max_steps is then the cap
    max_minutes: (
        Annotated[float, check(lambda v: 0 < v < math.inf, "null or a number of minutes > 0")]
        | None
    )

    @model_validator(mode="after")
    def _rules(self) -> TrainConfig:
        steps = self.trainer.get("max_steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
            fail("trainer.max_steps", steps, "a positive integer (the LR schedule is per step)")
        precision = str(self.trainer.get("precision", "32-true"))
        if precision not in PRECISIONS:
            fail("trainer.precision", precision, f"one of {', '.join(PRECISIONS)}")
        if self.data.offline and self.head.hidden_state_offset:
            fail(
                "head.hidden_state_offset",
                self.head.hidden_state_offset,
                "offline training caches the last hidden state only; use 0",
            )
        return self
