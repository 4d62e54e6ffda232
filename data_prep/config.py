"""Schema of `hydra-heads prep` (conf/prep.yaml, conf/data/); the values live in conf/ only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import model_validator

from data_prep.normalize import ROLES
from train.core.base import BaseConfig
from train.core.config import ConfigModel, Fraction, NonNegative, Positive, check, fail
from train.core.errors import UserError

_ROLE_LIST = ", ".join(ROLES)
Format = Literal["auto", "json", "jsonl", "hf_disk"]


class RegenError(UserError, RuntimeError):
    """Regeneration cannot run with this base model or server; the message says why."""


class SourceConfig(ConfigModel):
    """One input of a mixture: an item of `data.sources` (semantics: conf/data/_shared.yaml).

    Items are written inline on the command line, so the optional keys cannot take their values
    from conf/: null here means "as the rest of `data`" (format), the file's stem (name) or no
    cap (max_conversations), and DataConfig fills in format and name."""

    path: Annotated[str, check(bool, "a local file or dir (JSON array, JSON lines, save_to_disk)")]
    weight: Annotated[float, check(lambda v: v > 0 and math.isfinite(v), "a number > 0")]
    format: Format | None = None
    # conversation ids in the output are `<name>/<record id>`, hence no '/'
    name: (
        Annotated[str, check(lambda v: bool(v) and "/" not in v, "a non-empty name without '/'")]
        | None
    ) = None
    max_conversations: Positive | None = None  # read at most this many records of this source


class DataConfig(ConfigModel):
    """A raw chat data source and how it becomes training samples (`conf/data/*.yaml`)."""

    name: str
    # A local file or dir; or `package_file: "pkg:relative/path"` for data shipped in a package.
    path: str | None
    package_file: (
        Annotated[str, check(lambda v: ":" in v, "use the form 'package:relative/path'")] | None
    )
    format: Format
    split: str | None  # split to read from an on-disk DatasetDict
    turns_field: str | None  # name of the turns list; default: conversations / messages
    # extra raw-role -> role mappings, e.g. {bot: assistant}
    roles: (
        dict[
            str,
            Annotated[str, check(lambda r: r in ROLES, f"map raw roles onto one of {_ROLE_LIST}")],
        ]
        | None
    )
    loss_roles: list[str]  # roles whose tokens are trained on
    # assistant reasoning (reasoning_content / <think> blocks): trained on, context only, or removed
    reasoning: Literal["train", "mask", "drop"]
    train_only_last_turn: bool  # loss only on the assistant turns after the last user turn
    max_conversations: Positive | None  # read at most this many input records
    # pass over this many records first (they are not read): with max_conversations, the next
    # slice of a large corpus, e.g. records 2400..4799 after a prep of the first 2400
    skip_records: NonNegative
    max_length: Annotated[int, check(lambda v: v >= 16, "an integer >= 16 (tokens per sample)")]
    long_conversations: Literal["split", "truncate", "drop"]
    min_trainable_tokens: Positive
    pack: bool
    dedup: bool
    val_fraction: Fraction
    num_shards: Positive | None  # Arrow shards per split; default: one per 256 MB, >= 1
    # A weighted, seeded mixture of several inputs (data=mixture; rules: conf/data/mixture.yaml
    # and data_prep/mixture.py); set, it replaces path / package_file.
    sources: list[SourceConfig] | None

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.sources is not None:
            self._mixture()
            if self.skip_records:
                fail(
                    "skip_records",
                    self.skip_records,
                    "0 with data.sources: skipping applies to one input (data.path / "
                    "data.package_file); cap each source with its max_conversations",
                )
        elif (self.path is None) == (self.package_file is None):
            fail("path", self.path, "set exactly one of data.path or data.package_file")
        if not self.loss_roles:
            fail("loss_roles", self.loss_roles, "name at least one role, e.g. [assistant]")
        if any(r not in ROLES for r in self.loss_roles):
            fail("loss_roles", self.loss_roles, f"roles are {_ROLE_LIST}")
        return self

    def _mixture(self) -> None:
        """Check data.sources and fill in each source's format and name."""
        if not self.sources:
            fail("sources", [], "list at least one source, e.g. [{path: FILE, weight: 1}]")
        for key in ("path", "package_file"):
            if getattr(self, key) is not None:
                fail(
                    key,
                    getattr(self, key),
                    "data.sources replaces data.path and data.package_file: use data=mixture "
                    "(which sets neither), or set data.path=null data.package_file=null",
                )
        for i, s in enumerate(self.sources):
            s.format = s.format or self.format
            s.name = s.name or Path(s.path).expanduser().resolve().stem or f"source{i}"
        names = [s.name for s in self.sources]
        if len(set(names)) < len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            fail(
                "sources",
                names,
                f"sources need distinct names ({', '.join(dup)} repeats): name one, e.g. "
                "{path: FILE, weight: 1, name: other}",
            )


class RegenConfig(ConfigModel):
    """Self-distillation: the base model rewrites assistant turns (`prep regenerate=true`)."""

    max_new_tokens: Positive
    temperature: Annotated[float, check(lambda v: v >= 0, "a number >= 0 (0 = greedy)")]
    top_p: Annotated[float, check(lambda v: 0 < v <= 1, "a number in (0, 1]")]
    batch_size: Positive  # most turns per generation batch (prompts sorted by length)
    # and most cached tokens per batch: rows x (longest prompt + max_new_tokens)
    batch_tokens: Positive
    shard_size: Positive  # conversations per resumable shard
    max_turns: Positive | None  # regenerate at most this many assistant turns per conversation
    max_prompt_tokens: Positive | None  # a longer prompt ends its conversation before that turn
    device: str  # auto = cuda when available, else cpu
    # the local base's float32 CPU linears: oneDNN-prepacked weights at every row count
    # (packed), where timed faster (auto, which may choose differently run to run), or never
    # (standard); eval.weight_layout's choices (docs/eval.md)
    weight_layout: Literal["packed", "standard", "auto"]
    # with cache_hidden=true: save the base's hidden states as regeneration computes them, and
    # let caching take them instead of running the base over those samples again
    keep_states: bool
    # the local base: a regenerated conversation's sample is the token ids its last turn ran
    # over (the reply as generated) rather than its text tokenized anew (see conf/prep.yaml)
    token_ids: bool
    # local: the base runs in this process | openai: an OpenAI-compatible chat-completions
    # server (vLLM, SGLang, TGI, llama.cpp) serving the same base
    backend: Literal["local", "openai"]
    url: str | None  # openai: the API root, e.g. http://localhost:8000/v1
    model: str | None  # openai: the served model's name
    api_key_env: str | None  # openai: the environment variable holding the API key (or none)
    concurrency: Positive  # openai: requests in flight at once
    timeout_s: Annotated[float, check(lambda v: v > 0, "seconds > 0")]
    retries: Annotated[int, check(lambda v: v >= 0, "an integer >= 0")]  # per request
    backoff_s: Annotated[float, check(lambda v: v >= 0, "seconds >= 0")]  # doubled per retry

    @model_validator(mode="after")
    def _endpoint(self) -> RegenConfig:
        if self.backend == "openai":
            for key in ("url", "model"):
                if not getattr(self, key):
                    fail(key, getattr(self, key), "regen.backend=openai needs the server's " + (
                        "API root, e.g. regen.url=http://localhost:8000/v1" if key == "url"
                        else "model name, e.g. regen.model=HuggingFaceTB/SmolLM2-135M-Instruct"
                    ))  # fmt: skip
            if not self.url.startswith(("http://", "https://")):
                fail("url", self.url, "an http:// or https:// URL")
        return self


class PrepConfig(ConfigModel):
    """Everything `hydra-heads prep` needs (conf/prep.yaml)."""

    out: Annotated[str, check(bool, "the output directory for the prepared dataset")]
    base: BaseConfig
    data: DataConfig
    seed: int
    num_proc: Annotated[int, check(lambda v: v >= 1, "a positive integer or null (auto)")] | None
    batch_size: Positive  # conversations per tokenizer call
    overwrite: bool
    regenerate: bool
    regen: RegenConfig
    # Offline training: store the base's last hidden state (fp16) for every token.
    cache_hidden: bool
    cache_batch_size: Positive
    cache_device: str
    # ...and, for head=eagle3 offline, its fused layers (indices of transformers'
    # hidden_states, as head.aux_layers; null: none)
    cache_aux_layers: list[NonNegative] | None
    # Another prepared dataset whose samples (tokens, masks, splits) are kept as they are: only
    # the hidden states are cached anew (e.g. adding EAGLE-3's layers without regenerating).
    # A list of several: their samples merged (duplicates dropped), with the states they hold
    # or, with cache_hidden=true, states cached anew.
    from_prepared: str | list[str] | None

    @model_validator(mode="after")
    def _caching(self) -> PrepConfig:
        if self.cache_aux_layers is not None:
            if not self.cache_hidden:
                fail("cache_hidden", False, "true: cache_aux_layers caches beside the hidden state")
            if not self.cache_aux_layers:
                fail("cache_aux_layers", [], "layer indices, e.g. [2, 15, 27], or null")
        sources = self.prepared_sources()
        if isinstance(self.from_prepared, list):
            if not sources:
                fail("from_prepared", [], "one prepared dir, or a list of several to merge")
            if len(set(map(str, sources))) < len(sources):
                fail("from_prepared", self.from_prepared, "distinct dirs (one is listed twice)")
        if len(sources) == 1 and not self.cache_hidden:
            fail(
                "cache_hidden",
                False,
                "true: from_prepared with one dir only caches hidden states anew (list several "
                "dirs to merge them)",
            )
        return self

    def prepared_sources(self) -> list[Path]:
        """from_prepared as a list of dirs (empty: prep reads data)."""
        if self.from_prepared is None:
            return []
        dirs = [self.from_prepared] if isinstance(self.from_prepared, str) else self.from_prepared
        return [Path(d).expanduser().resolve() for d in dirs]
