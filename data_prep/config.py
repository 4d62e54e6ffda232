"""Typed, validated configuration of `hydra-heads prep` (mirrors conf/prep.yaml and conf/data/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from data_prep.normalize import ROLES
from train.base import BaseConfig
from train.config import fail


@dataclass
class DataConfig:
    """A raw chat data source and how it becomes training samples (`conf/data/*.yaml`)."""

    name: str
    # A local file or dir; or `package_file: "pkg:relative/path"` for data shipped in a package.
    path: str | None = None
    package_file: str | None = None
    format: Literal["auto", "json", "jsonl", "hf_disk"] = "auto"
    split: str | None = None  # split to read from an on-disk DatasetDict
    turns_field: str | None = None  # name of the turns list; default: conversations / messages
    roles: dict[str, str] | None = None  # extra raw-role -> role mappings
    loss_roles: list[str] = field(default_factory=lambda: ["assistant"])
    max_conversations: int | None = None  # read at most this many input records
    max_length: int = 2048
    long_conversations: Literal["split", "truncate", "drop"] = "split"
    min_trainable_tokens: int = 1
    pack: bool = False
    dedup: bool = True
    val_fraction: float = 0.02
    num_shards: int | None = None  # Arrow shards per split; default: one per 256 MB, >= 1

    def __post_init__(self) -> None:
        if (self.path is None) == (self.package_file is None):
            fail("path", self.path, "set exactly one of data.path or data.package_file")
        if self.package_file is not None and ":" not in self.package_file:
            fail("package_file", self.package_file, "use the form 'package:relative/path'")
        for r in self.loss_roles:
            if r not in ROLES:
                fail("loss_roles", self.loss_roles, f"roles are {', '.join(ROLES)}")
        if not self.loss_roles:
            fail("loss_roles", self.loss_roles, "name at least one role, e.g. [assistant]")
        for raw, role in (self.roles or {}).items():
            if role not in ROLES:
                fail(f"roles.{raw}", role, f"map raw roles onto one of {', '.join(ROLES)}")
        if self.max_conversations is not None and self.max_conversations <= 0:
            fail("max_conversations", self.max_conversations, "a positive integer or null")
        if self.max_length < 16:
            fail("max_length", self.max_length, "an integer >= 16 (tokens per sample)")
        if self.min_trainable_tokens < 1:
            fail("min_trainable_tokens", self.min_trainable_tokens, "an integer >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            fail("val_fraction", self.val_fraction, "a fraction in [0, 1)")
        if self.num_shards is not None and self.num_shards < 1:
            fail("num_shards", self.num_shards, "a positive integer or null")


@dataclass
class RegenConfig:
    """Self-distillation: the base model rewrites assistant turns (`prep regenerate=true`)."""

    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 8
    shard_size: int = 64  # conversations per resumable shard
    max_turns: int | None = None  # regenerate at most this many assistant turns per conversation
    device: str = "auto"  # auto = cuda when available, else cpu

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            fail("max_new_tokens", self.max_new_tokens, "a positive integer")
        if self.temperature < 0:
            fail("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            fail("top_p", self.top_p, "a number in (0, 1]")
        for k in ("batch_size", "shard_size"):
            if getattr(self, k) < 1:
                fail(k, getattr(self, k), "a positive integer")
        if self.max_turns is not None and self.max_turns < 1:
            fail("max_turns", self.max_turns, "a positive integer or null")


@dataclass
class PrepConfig:
    """Everything `hydra-heads prep` needs (`conf/prep.yaml`)."""

    out: str
    base: BaseConfig
    data: DataConfig
    seed: int = 0
    num_proc: int | None = None  # tokenizer processes; default: cpus / 2, at most 8
    batch_size: int = 256  # conversations per tokenizer call
    overwrite: bool = False
    regenerate: bool = False
    regen: RegenConfig = field(default_factory=RegenConfig)
    # Offline training: store the base's last hidden state (fp16) for every token.
    cache_hidden: bool = False
    cache_batch_size: int = 4
    cache_device: str = "auto"

    def __post_init__(self) -> None:
        if not self.out:
            fail("out", self.out, "the output directory for the prepared dataset")
        if self.num_proc is not None and self.num_proc < 1:
            fail("num_proc", self.num_proc, "a positive integer or null (auto)")
        if self.batch_size < 1:
            fail("batch_size", self.batch_size, "a positive integer")
        if self.cache_batch_size < 1:
            fail("cache_batch_size", self.cache_batch_size, "a positive integer")
