"""Prompt sets for decoding: held-out first turns of prepared data, or a jsonl of prompts / chats
(the named suites, MT-Bench and HumanEval, are in evaluation/suites.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.core.errors import ConfigError, NotFound
from train.core.readers import DEFAULT_ROLE_MAP, DataError, SkipLog, iter_jsonl


@dataclass
class PromptItem:
    """One evaluation item: either a ready token prompt, or a chat whose user turns are answered
    one after another (each reply generated here is appended before the next user turn).
    `category` groups eval.json's per-category figures (MT-Bench's categories, "heldout", ...)."""

    name: str
    tokens: list[int] | None = None
    system: str | None = None
    user_turns: list[str] = field(default_factory=list)
    category: str = "uncategorized"

    @property
    def num_turns(self) -> int:
        return 1 if self.tokens is not None else len(self.user_turns)


def parse_prompt_row(record: Any) -> tuple[str | None, list[str]]:
    """(system prompt, user turns) of a jsonl row: {"prompt": str}, MT-Bench's {"turns": [str]},
    or a chat ({"messages"|"conversations": [{"role"|"from", "content"|"value"}]}) whose
    assistant turns are ignored: the model writes its own. Raises ValueError with the reason."""
    if not isinstance(record, Mapping):
        raise ValueError(f"row is a {type(record).__name__}, not an object")
    if isinstance(record.get("prompt"), str):
        turns = [record["prompt"]]
        system = record.get("system") if isinstance(record.get("system"), str) else None
    elif isinstance(record.get("turns"), list):
        turns = record["turns"]
        system = None
        if not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a list of strings")
    else:
        msgs = next(
            (record[k] for k in ("messages", "conversations", "conversation") if k in record), None
        )
        if not isinstance(msgs, list):
            raise ValueError('no "prompt", "turns", "messages" or "conversations" field')
        system, turns = None, []
        for j, m in enumerate(msgs):
            if not isinstance(m, Mapping):
                raise ValueError(f"turn {j} is not an object")
            role = DEFAULT_ROLE_MAP.get(str(m.get("role", m.get("from", ""))).strip().lower())
            content = m.get("content", m.get("value"))
            if role is None or not isinstance(content, str):
                raise ValueError(f"turn {j} has no known role or no string content")
            if role == "system" and j == 0:
                system = content
            elif role == "user":
                turns.append(content)
    turns = [t for t in turns if t.strip()]
    if not turns:
        raise ValueError("no non-empty user turn")
    return system, turns


def jsonl_prompts(path: str | Path, limit: int | None, skips: SkipLog) -> list[PromptItem]:
    """The first `limit` usable rows of the jsonl file `path` (see parse_prompt_row; bad rows
    are counted in `skips`), in file order; a row's string "category" is kept, else "file"."""
    p = Path(path)
    if not p.is_file():
        raise NotFound(
            f"eval.prompts={p} does not exist: give a .jsonl file with one "
            '{"prompt": "..."} or chat conversation per line'
        )
    items: list[PromptItem] = []
    for where, record in iter_jsonl(p, skips):
        try:
            system, turns = parse_prompt_row(record)
        except ValueError as e:
            skips.skip("bad_prompt_row", where, str(e))
            continue
        category = record.get("category")
        category = category if isinstance(category, str) and category else "file"
        items.append(PromptItem(where, system=system, user_turns=turns, category=category))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DataError(f"{p} holds no usable prompt row ({dict(skips.counts)} skipped)")
    return items


def first_turn_prompt(input_ids: list[int], loss_mask: list[int]) -> list[int] | None:
    """The tokens before the first assistant token of a prepared row: the system prompt, the
    first user turn and the assistant header, exactly as the chat template rendered them."""
    first = loss_mask.index(1) if 1 in loss_mask else 0
    return input_ids[:first] if first > 0 else None


def check_prepared_base(
    path: str | Path, tokenizer, where: str, hidden_size: int | None = None
) -> None:
    """Refuse a prep output made for another base: its tokens from another vocabulary (the
    tokenizer fingerprint prep records), or, given `hidden_size`, its cached hidden states of
    another width. Outputs of older releases, which record neither, pass."""
    import json

    from train.core.base import tokenizer_fingerprint

    p = Path(path).expanduser()
    try:
        stats = json.loads((p / "prep_stats.json").read_text())
    except (OSError, ValueError):
        return  # a missing or damaged output is reported by whoever reads its rows
    if not isinstance(stats, dict):
        return
    made_for = stats.get("base")
    recorded = stats.get("tokenizer")
    if recorded and recorded != (ours := tokenizer_fingerprint(tokenizer)):
        raise ConfigError(
            f"{where}={p} was tokenized for another base (base={made_for}, tokenizer {recorded}) "
            f"than this one's tokenizer ({ours}): prepare it again "
            f"with this base (`hydra-heads prep ... base=...`), or use the base it was made for"
        )
    cached = stats.get("cached_hidden_size")
    if hidden_size is not None and cached is not None and int(cached) != int(hidden_size):
        raise ConfigError(
            f"{where}={p} holds hidden states of width {cached} (base={made_for}), but this "
            f"base's hidden size is {hidden_size}: cache them with this base (`hydra-heads prep "
            f"from_prepared={p} cache_hidden=true base=... out=NEW_DIR`) or set "
            "data.offline=false"
        )


def prepared_rows(path: str | Path, split: str = "validation"):
    """The `split` of a `hydra-heads prep` output (an Arrow dataset on disk)."""
    import datasets

    p = Path(path)
    if not (p / "dataset_dict.json").is_file():
        raise NotFound(
            f"{p} is not a `hydra-heads prep` output (no dataset_dict.json); pass "
            "eval.prepared=DIR or eval.prompts=FILE.jsonl"
        )
    dd = datasets.load_from_disk(str(p))
    if split not in dd or len(dd[split]) == 0:
        raise DataError(
            f"{p} has no {split} rows: prepare with a validation split (data.val_fraction > 0) "
            "or pass eval.prompts=FILE.jsonl"
        )
    return dd[split]


def held_out_prompts(ds, limit: int, max_prompt_tokens: int) -> tuple[list[PromptItem], int]:
    """First-turn prompts from the first rows of a prepared split; returns them and the index
    of the first row not looked at (calibration reads from there on, so the two never mix)."""
    items: list[PromptItem] = []
    i = 0
    for i, row in enumerate(ds):  # noqa: B007 - the index is returned
        if len(items) >= limit:
            break
        ids = first_turn_prompt(list(row["input_ids"]), list(row["loss_mask"]))
        if ids is not None and len(ids) <= max_prompt_tokens:
            items.append(PromptItem(f"validation[{i}]", tokens=ids, category="heldout"))
    else:
        i = len(ds)
    return items, i
