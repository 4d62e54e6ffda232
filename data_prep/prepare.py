"""`hydra-heads prep`: raw chat data -> tokenized, loss-masked, split Arrow shards + stats."""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import itertools
import json
import math
import os
import random
import shutil
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
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
from data_prep.spool import BATCH_ROWS, column_array, iter_batches, spool
from data_prep.template import (
    TemplateError,
    chunk,
    encode_batch,
    generated_encoding,
    mask_method,
)
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
    data: DataConfig, skips: SkipLog, seed: int = 0, work: Path | None = None
) -> tuple[Any, dict[str, Any]]:
    """Read, normalize and deduplicate conversations; bad rows are skipped and counted. With
    data.sources: the seeded mixture of those sources (read_mixture).

    The conversations come as a Dataset of _read_features(), spooled to Arrow files in `work`
    as they are read (data_prep/spool.py), so a corpus larger than memory reads in bounded
    memory; without `work`, in a temporary dir removed when the Dataset is collected."""
    if work is None:
        work = Path(tempfile.mkdtemp(prefix="hydra-prep-"))
        rows, info = read_conversations(data, skips, seed, work)
        weakref.finalize(rows, shutil.rmtree, work, True)
        return rows, info
    if data.sources is not None:
        return read_mixture(data, skips, seed, work)
    path = resolve_input(data)
    norm = NormalizeStats()
    rows, n_read, n_row_skips = _read_source(
        path,
        data.format,
        data.max_conversations,
        data,
        skips,
        norm,
        {},
        work / "source.arrow",
        skip=data.skip_records,
    )
    info = {
        "input": str(path),
        # Records seen, including lines or records the reader could not parse.
        "records_read": n_read + sum(skips.counts.values()) - n_row_skips,
        "leading_assistant_turns_dropped": norm.leading_assistant_turns_dropped,
        "trailing_user_turns_dropped": norm.trailing_user_turns_dropped,
    }
    return rows, info


def _read_features():
    """Arrow schema of the conversations read (read_conversations' rows)."""
    from datasets import Features, Sequence, Value

    text = Value("string")
    return Features(
        {
            "conv_id": text,
            "key": text,
            "roles": Sequence(text),
            "contents": Sequence(text),
            "extras": text,
        }
    )


def _read_source(
    path: Path,
    fmt: str,
    max_records: int | None,
    data: DataConfig,
    skips: SkipLog,
    norm: NormalizeStats,
    seen: dict[bytes, str | None],
    spool_to: Path,
    source: str | None = None,
    skip: int = 0,
) -> tuple[Any, int, int]:
    """The usable conversations of one input, spooled to the Arrow file `spool_to` as they are
    read, and (records parsed, parsed ones rejected here).

    `seen` maps the conversation keys (as bytes) taken so far to their source (None outside a
    mixture), for dedup across sources: the one thing read that stays in memory, ~100 bytes a
    conversation. A mixed conversation's id is `<source>/<record id>`. The first `skip` records
    are passed over unread (data.skip_records); records the reader cannot parse are counted
    wherever they are."""
    from tqdm.auto import tqdm

    role_map = {**DEFAULT_ROLE_MAP, **{k.lower(): v for k, v in (data.roles or {}).items()}}
    counts = {"read": 0, "row_skips": 0}  # row_skips: parsed here but rejected (the reader
    # counts the rest)

    def usable() -> Iterator[dict]:
        bar = tqdm(desc=f"reading {path.name}", unit=" conv", total=max_records)
        records = iter_records(path, fmt, skips, data.split)
        for _ in itertools.islice(records, skip):
            pass
        for where, record in records:
            if max_records is not None and counts["read"] >= max_records:
                break
            counts["read"] += 1
            bar.update()
            try:
                msgs = normalize(record, role_map, data.turns_field, norm)
            except RowError as e:
                skips.skip(e.reason, where, e.detail)
                counts["row_skips"] += 1
                continue
            key = conversation_key(msgs)
            digest = bytes.fromhex(key)
            if data.dedup and digest in seen:
                if seen[digest] == source:
                    skips.skip("duplicate", where, "identical to an earlier conversation")
                else:
                    detail = f"identical to a conversation of source '{seen[digest]}'"
                    skips.skip("cross_source_duplicate", where, detail)
                counts["row_skips"] += 1
                continue
            seen[digest] = source
            cid = record.get("id") if isinstance(record.get("id"), str) else None
            cid = cid or where.rsplit("/", 1)[-1]
            yield {
                "conv_id": f"{source}/{cid}" if source is not None else cid,
                "key": key,
                "roles": [m["role"] for m in msgs],
                "contents": [m["content"] for m in msgs],
                "extras": pack_extras(msgs),
            }
        bar.close()

    rows = spool(usable(), spool_to, _read_features())
    return rows, counts["read"], counts["row_skips"]


def _mix(data: DataConfig, pools: list, per_source: dict, seed: int, skips: SkipLog):
    """Each source's seeded share of data.max_conversations, concatenated, and the quotas;
    per_source gains each source's share, target, selected and shortfall."""
    from datasets import concatenate_datasets

    weights = [s.weight for s in data.sources]
    targets = quotas([len(p) for p in pools], weights, data.max_conversations)
    parts = []
    for src, pool, target in zip(data.sources, pools, targets, strict=True):
        chosen = select(len(pool), target, seed, src.name)
        parts.append(pool.select(chosen))
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
    return concatenate_datasets(parts), targets


def read_mixture(
    data: DataConfig, skips: SkipLog, seed: int, work: Path
) -> tuple[Any, dict[str, Any]]:
    """The conversations of data.sources, mixed by weight (data_prep.mixture has the rules),
    and read_conversations' info plus "sources" (per-source counts) and "mixture"."""
    seen: dict[bytes, str | None] = {}
    pools: list[Any] = []
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
                path,
                src.format,
                src.max_conversations,
                data,
                own,
                norm,
                seen,
                work / f"source-{i}.arrow",
                src.name,
            )
        except DataError as e:
            raise DataError(f"{where}: {e}") from e
        if not len(rows):
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
    mixed, targets = _mix(data, pools, per_source, seed, skips)
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
    kept_by: Counter = Counter()
    for b in iter_batches(kept, ["conv_id", "piece"]):
        kept_by.update(
            cid.split("/", 1)[0] for cid, p in zip(b["conv_id"], b["piece"], strict=True) if p == 0
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
    n_rows = len(batch["roles"])
    gen_ids = batch.get("token_ids") if cfg.get("token_ids") else None
    gen_ids = gen_ids or [None] * n_rows
    reply_at = batch.get("reply_at") or [None] * n_rows
    for cid, key, enc, ids_, at in zip(
        batch["conv_id"], batch["key"], encoded, gen_ids, reply_at, strict=True
    ):
        split = "validation" if _is_validation(key, cfg["seed"], cfg["val_fraction"]) else "train"
        ids_from = ""  # "generated": regen.token_ids' sample; text:<why> where it fell back
        if ids_ and not isinstance(enc, TemplateError):
            got = generated_encoding(enc, list(ids_), list(at))
            ids_from = "text:" + got if isinstance(got, str) else "generated"
            enc = enc if isinstance(got, str) else got
        elif cfg.get("token_ids") and "token_ids" in batch and not isinstance(enc, TemplateError):
            ids_from = "text:none"  # a server's reply, or none recorded (regenerate.py)

        def emit(ids, mask, reason, n_conv, piece, detail="", cid=cid, split=split, f=ids_from):
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
            out["skip_detail"].append(detail)
            out["ids_from"].append(f)

        if isinstance(enc, TemplateError):
            emit([], [], "template_error", 0, 0, detail=str(enc))
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
    cols |= {"conv_tokens": i32, "piece": i32, "split": text}
    return Features({**cols, "skip_reason": text, "skip_detail": text, "ids_from": text})


def pack_samples(part, max_length: int, seed: int) -> Iterator[dict]:
    """Greedily concatenate the samples of the Dataset `part` (in a seeded random order) into
    rows of <= max_length, yielded one at a time: the order and the rule need the lengths only,
    and the samples are read a block of rows at a time.

    `seq_lens` keeps each row's segment lengths so training can keep attention inside a segment.
    """
    lengths = column_array(part, "length")
    order = list(range(len(part)))
    random.Random(seed).shuffle(order)
    groups: list[list[int]] = []  # the samples of each packed row, in packing order
    total = max_length + 1
    for i in order:
        n = int(lengths[i])
        if groups and total + n <= max_length:
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    cols = ["conv_id", "input_ids", "loss_mask", "length", "num_trainable"]
    for start in range(0, len(groups), BATCH_ROWS):
        block = groups[start : start + BATCH_ROWS]
        flat = [i for g in block for i in g]
        where = {i: j for j, i in enumerate(flat)}
        rows = part.select_columns(cols).select(flat).to_dict()
        for g in block:
            js = [where[i] for i in g]
            ids: list[int] = []
            mask: list[int] = []
            for j in js:
                ids += rows["input_ids"][j]
                mask += rows["loss_mask"][j]
            yield {
                "conv_id": "+".join(rows["conv_id"][j] for j in js),
                "input_ids": ids,
                "loss_mask": mask,
                "length": sum(rows["length"][j] for j in js),
                "num_trainable": sum(rows["num_trainable"][j] for j in js),
                "seq_lens": [rows["length"][j] for j in js],
            }


def _percentiles(values) -> dict[str, float]:
    if not len(values):
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
    for col in ("conv_id", "length"):  # the bytes of json.dumps(ds[col]), a batch at a time
        h.update(b"[")
        first = True
        for b in iter_batches(ds, [col]):
            for v in b[col]:
                h.update((json.dumps(v) if first else ", " + json.dumps(v)).encode())
                first = False
        h.update(b"]")
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


def tokenize(rows, tokenizer, cfg: PrepConfig, work: Path | None = None):
    """Conversations (read_conversations' Dataset, or a list of its rows) -> a Dataset of
    _features(), one row per sample or per skipped conversation (its skip_reason set), written
    to `work` (default: a temporary dir) as it is made. Returns (it, the processes used)."""
    import datasets

    datasets.disable_caching()
    datasets.logging.set_verbosity_error()
    # The Rust tokenizer already spreads one process's batch over all cores; extra processes
    # only pay off for the Python side (templates, masks) on machines with cores to spare.
    num_proc = cfg.num_proc or max(1, min((os.cpu_count() or 1) // 2, 8))
    if len(rows) < 4 * cfg.batch_size:
        num_proc = 1  # process start-up would cost more than it saves
    if isinstance(rows, list):
        rows = datasets.Dataset.from_list(rows)  # regenerated rows: their own columns
    raw = rows
    if work is None:
        work = Path(tempfile.mkdtemp(prefix="hydra-prep-"))
    work.mkdir(parents=True, exist_ok=True)
    map_cfg = {**cfg.data.model_dump(), "seed": cfg.seed}  # plain values: pickled to workers
    map_cfg["mask_method"] = mask_method(tokenizer, tuple(cfg.data.loss_roles))
    map_cfg["token_ids"] = cfg.regenerate and cfg.regen.token_ids
    tok = raw.map(
        _tokenize_batch,
        batched=True,
        batch_size=cfg.batch_size,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=raw.column_names,
        fn_kwargs={"tokenizer": tokenizer, "cfg": map_cfg},
        features=_features(),
        cache_file_name=str(work / "tokenized.arrow"),
        desc=f"tokenizing ({num_proc} proc)",
    )
    return tok, num_proc


def kept_samples(tok, skips: SkipLog):
    """Count `tok`'s skipped conversations in `skips`; returns (its kept samples, the token
    count of each tokenized conversation before any cut). PrepError if none is kept."""
    lengths = []
    cols = ["conv_id", "skip_reason", "skip_detail", "conv_tokens", "piece"]
    for b in iter_batches(tok, cols):
        for cid, r, why in zip(b["conv_id"], b["skip_reason"], b["skip_detail"], strict=True):
            if r:  # why: what the chat template said, for a template_error
                skips.skip(r, f"conversation {cid}", why)
        n, p = np.asarray(b["conv_tokens"]), np.asarray(b["piece"])
        lengths.append(n[(p == 0) & (n > 0)])
    conv_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    kept = tok.filter(lambda r: [x == "" for x in r], input_columns="skip_reason", batched=True)
    if len(kept) == 0:
        raise PrepError(f"every conversation was dropped (skipped: {dict(skips.counts)})")
    return kept, conv_lengths


def split_samples(kept, split: str, cfg: PrepConfig, work: Path | None = None):
    """The `split` samples of `kept`, packed if data.pack (spooled to `work`, default a
    temporary dir), in the saved columns (with seq_lens) and with a fingerprint derived from
    their content."""
    from datasets import Dataset

    part = kept.filter(lambda s: [x == split for x in s], input_columns="split", batched=True)
    part = part.select_columns(["conv_id", "input_ids", "loss_mask", "length", "num_trainable"])
    if len(part) == 0:
        part = Dataset.from_dict({c: [] for c in _features(True)}, features=_features(True))
    elif cfg.data.pack:
        work = work or Path(tempfile.mkdtemp(prefix="hydra-prep-"))
        packed = pack_samples(part, cfg.data.max_length, cfg.seed)
        part = spool(packed, work / f"packed-{split}.arrow", _features(True))
    else:
        part = part.map(
            lambda r: {"seq_lens": [[n] for n in r]},
            input_columns="length",
            batched=True,
            cache_file_name=str(work / f"split-{split}.arrow") if work else None,
        )
    if part.features != _features(True):
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
    partial.mkdir(parents=True, exist_ok=True)
    for stale in partial.glob("spool-*"):  # a killed run's working files
        shutil.rmtree(stale, ignore_errors=True)
    work = partial / f"spool-{os.getpid()}"
    sources = cfg.prepared_sources()
    keep_states = len(sources) > 1 and not cfg.cache_hidden
    if sources:
        from train.core.base import load_tokenizer, tokenizer_fingerprint

        # loaded once a source's stats and base name have passed (a typo fails first)
        fingerprint = functools.cache(lambda: tokenizer_fingerprint(load_tokenizer(cfg.base)))
        if len(sources) == 1:
            dd, stats = _prepared_samples(sources[0], out, cfg.base.name, fingerprint)
        else:
            dd, stats = _merged_samples(sources, out, cfg.base.name, fingerprint, keep_states)
        num_proc = None
        # each source records this fingerprint, or (an older release) none under this base name
        stats["tokenizer"] = fingerprint()
    else:
        dd, make_stats, num_proc = _samples(cfg, timing, t_start, partial, work)
    aux = tuple(cfg.cache_aux_layers) if cfg.cache_aux_layers else None
    if cfg.cache_hidden:
        from data_prep.hidden import cache_hidden_states, chunk_dir

        with _timed(timing, "cache_hidden_s"):
            if ranks.world > 1:  # the samples, for the other ranks to cache their share of
                shared = _shared_samples(partial, cfg)
                if not shared.is_dir():
                    with staged_dir(shared, keep_existing=True) as tmp:
                        dd.save_to_disk(str(tmp))
            device = _regen_device(cfg.cache_device)
            work = chunk_dir(partial, dd, cfg.base, cfg.cache_batch_size, aux)
            for stale in partial.glob("hidden-*"):  # chunks of other samples, base or layout:
                if stale != work:  # never read again, and as large as the states themselves
                    shutil.rmtree(stale, ignore_errors=True)
            regen = _regen_states(cfg, partial)
            dd = cache_hidden_states(
                dd, cfg.base, cfg.cache_batch_size, device, work, ranks, aux, regen
            )
        timing["cache_processes"] = ranks.world
    if not sources:
        stats = make_stats(dd)
    if not keep_states:  # else the merged sources' own states, which they share
        stats.update(cached_hidden=cfg.cache_hidden, cached_aux_layers=cfg.cache_aux_layers)
    if cfg.cache_hidden and not sources and cfg.regenerate:  # how many the base ran over again
        stats["cached_from_regeneration"] = regen.taken_samples if regen is not None else 0
    feats = next(iter(dd.values())).features
    if "hidden" in feats:  # offline training checks it against its base's hidden size
        stats["cached_hidden_size"] = int(feats["hidden"].shape[1])
    else:
        stats.pop("cached_hidden_size", None)
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


def _samples(cfg: PrepConfig, timing: dict, t_start: float, partial: Path, work: Path):
    """Read, (regenerate,) tokenize and split cfg.data: (the DatasetDict, a function of the
    final DatasetDict giving prep_stats, the tokenizer's processes)."""
    from datasets import DatasetDict

    tokenizer = chat_tokenizer(cfg.base)
    timing["load_tokenizer_s"] = time.perf_counter() - t_start
    sources = cfg.data.sources
    skips = SourceSkips(sources=tuple(s.name for s in sources)) if sources else SkipLog()
    with _timed(timing, "read_s"):
        rows, read_info = read_conversations(cfg.data, skips, cfg.seed, work)
    if not len(rows):
        raise PrepError(
            f"no usable conversation in {read_info['input']} (skipped: "
            f"{dict(skips.counts)}); check data.format / data.turns_field"
        )
    if cfg.regenerate:
        regen: dict[str, Any] = {}
        with _timed(timing, "regenerate_s"):
            rows = _regenerated(cfg, rows, partial, skips, regen)
        read_info["regeneration"] = _regen_rates(regen, timing["regenerate_s"])
    with _timed(timing, "tokenize_s"):
        tok, num_proc = tokenize(rows, tokenizer, cfg, work)
    kept, conv_lengths = kept_samples(tok, skips)
    if sources:
        read_info["sources"] = _source_stats(read_info, skips, kept)
    dd = DatasetDict({split: split_samples(kept, split, cfg, work) for split in SPLITS})

    def make_stats(final) -> dict:
        return _stats(cfg, read_info, skips, kept, final, conv_lengths, tokenizer)

    return dd, make_stats, num_proc


def _regen_rates(regen: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """prep_stats.json's `regeneration` (regenerate.regen_summary) with its wall time, loading
    the base included, and where no shard was resumed, the turns it regenerated an hour."""
    regen["wall_s"] = round(wall_s, 1)
    if not regen["shards_resumed"] and wall_s > 0:
        regen["turns_per_hour"] = round(regen["turns"] * 3600 / wall_s)
    return regen


def _regenerated(cfg: PrepConfig, rows, partial: Path, skips, stats: dict | None = None) -> list:
    """The conversations with their assistant turns answered by the base (cfg.regen); `stats`
    gets regenerate's summary."""
    from data_prep.regenerate import regenerate
    from train.core.base import load_base

    if cfg.regen.backend == "openai":  # the server runs the model; the tokenizer here
        from types import SimpleNamespace

        from train.core.base import load_tokenizer

        base = SimpleNamespace(cfg=cfg.base, tokenizer=load_tokenizer(cfg.base), config=None)
    else:
        from train.decoding.backend import use_weight_layout

        base = load_base(cfg.base, device=_regen_device(cfg.regen.device))
        use_weight_layout(base.model, layout=cfg.regen.weight_layout, key="regen.weight_layout")
    keep = _keeps_states(cfg)
    rows = regenerate(
        rows.to_list(),
        base,
        cfg.regen,
        partial / "regen",
        cfg.seed,
        skips,
        keep_states=keep,
        stats=stats,
    )
    if not rows:
        raise PrepError(
            f"regeneration left no conversation (skipped {dict(skips.counts)}); for empty "
            "replies try regen.temperature > 0 or a larger regen.max_new_tokens, for long "
            "prompts a larger regen.max_prompt_tokens or a smaller regen.max_new_tokens"
        )
    return rows


def _prepared_samples(
    src: Path,
    out: Path,
    base_name: str,
    fingerprint: Callable[[], str],
    keep_states: bool = False,
):
    """from_prepared: another prepared dataset's samples without its cached states (with them:
    `keep_states`), and its stats (what it was made from), noting where they came from. The
    source must record `base_name` and, where it records one, the tokenizer `fingerprint()`."""
    from datasets import DatasetDict, load_from_disk

    from data_prep.hidden import AUX

    if src.resolve() == out:
        raise PrepError(f"from_prepared={src} is out= itself: write the new dataset elsewhere")
    stats_path = src / STATS_FILE
    if not stats_path.is_file():
        raise PrepError(
            f"from_prepared={src} is not a prepared dataset ({STATS_FILE} missing): give the "
            "out= directory of an earlier `hydra-heads prep`"
        )
    try:
        stats = json.loads(stats_path.read_text())
        dd = load_from_disk(str(src))
    except (OSError, ValueError) as e:
        raise PrepError(
            f"from_prepared={src} cannot be read ({type(e).__name__}: {e}); prepare it again"
        ) from None
    if not keep_states:
        dd = DatasetDict(
            {k: ds.remove_columns([c for c in ("hidden", AUX) if c in ds.column_names])
             for k, ds in dd.items()}
        )  # fmt: skip
    if stats.get("base") != base_name:  # its tokens are another base's: caching would mix them
        raise PrepError(
            f"from_prepared={src} was prepared for base={stats.get('base')}, not {base_name}: "
            f"pass base={stats.get('base')} (the states must come from the model whose tokens "
            "these are)"
        )
    recorded = stats.get("tokenizer")  # older releases record none
    if recorded and recorded != fingerprint():  # one name, another vocabulary (base.path)
        raise PrepError(
            f"from_prepared={src} was tokenized with another tokenizer (fingerprint {recorded}) "
            f"than base={base_name}'s ({fingerprint()}): its token ids mean other words here; "
            "prepare it again with this base, or pass the base it was made with"
        )
    stats["from_prepared"] = str(src.resolve())
    return dd, stats


# Settings of a prepared dataset that merged sources may differ in; each source's are kept in
# the merged stats' "merged_from", and the top level has the first source's.
_SOURCE_SETTINGS = (
    "input", "max_length", "long_conversations", "packed", "regenerated", "mask_method",
    "reasoning", "train_only_last_turn", "seed", "skip_records",
)  # fmt: skip


# Counts of a prepared dataset that a merge adds up.
_SUMMED = (
    "leading_assistant_turns_dropped", "trailing_user_turns_dropped", "conversations_split",
    "conversations_over_max_length",
)  # fmt: skip


def _sample_digests(part) -> np.ndarray:
    """A 16-byte digest of each sample's token ids, in order (merge's duplicate test)."""
    out = []
    for batch in part.with_format("arrow").select_columns(["input_ids"]).iter(BATCH_ROWS):
        ids = batch.column("input_ids").combine_chunks()
        offsets = ids.offsets.to_numpy()
        values = ids.values.to_numpy(zero_copy_only=False).astype(np.int64)
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):
            out.append(hashlib.blake2b(values[a:b].tobytes(), digest_size=16).digest())
    return np.array(out, dtype="S16")


def _merged_samples(
    srcs: list[Path],
    out: Path,
    base_name: str,
    fingerprint: Callable[[], str],
    keep_states: bool,
):
    """from_prepared=[A, B, ...]: the samples of several prepared datasets of one base, split by
    split in the order given, e.g. slices of one corpus prepared apart (data.skip_records). A
    sample whose tokens equal a sample of an earlier source (either split) is dropped and
    counted, so no validation sample repeats a training one. `keep_states` (cache_hidden=false):
    the sources' cached states are kept, which needs every source to hold the same ones."""
    from datasets import DatasetDict, concatenate_datasets

    parts = [_prepared_samples(src, out, base_name, fingerprint, keep_states) for src in srcs]
    if keep_states:
        held = [(bool(st.get("cached_hidden")), st.get("cached_aux_layers")) for _, st in parts]
        if len(set(map(str, held))) > 1:
            listing = "; ".join(
                f"{src}: hidden {'yes' if h else 'no'}, aux layers {aux or 'none'}"
                for src, (h, aux) in zip(srcs, held, strict=True)
            )
            raise PrepError(
                f"from_prepared: the datasets hold different cached states ({listing}); merge "
                "with cache_hidden=true (and cache_aux_layers as needed) to cache them all anew"
            )
    splits = [s for s in SPLITS if any(s in dd for dd, _ in parts)]
    seen: set[bytes] = set()
    merged: dict[str, list] = {s: [] for s in splits}
    sources = []
    for src, (dd, st) in zip(srcs, parts, strict=True):
        own: set[bytes] = set()
        entry = {"path": str(src.resolve()), "samples": {}, "duplicates_dropped": 0}
        for split in splits:
            if split not in dd:
                continue
            part = dd[split]
            digests = _sample_digests(part)
            fresh = np.array([d not in seen for d in digests.tolist()], dtype=bool)
            if not fresh.all():
                part = part.select(np.flatnonzero(fresh).tolist())
            entry["samples"][split] = len(part)
            entry["duplicates_dropped"] += int((~fresh).sum())
            own.update(digests.tolist())
            merged[split].append(part)
        seen |= own
        entry.update({k: st.get(k) for k in _SOURCE_SETTINGS})
        sources.append(entry)
    try:
        dd = DatasetDict({s: concatenate_datasets(merged[s]) for s in splits})
    except ValueError as e:  # e.g. one holds seq_lens or states the other lacks
        raise PrepError(
            f"from_prepared: the datasets' columns differ and cannot be merged ({e}); prepare "
            "them with the same version and options, or merge with cache_hidden=true"
        ) from None
    per_split, max_id = _split_stats(dd)
    first = parts[0][1]
    skipped = Counter()
    for _, st in parts:
        skipped.update(st.get("skipped") or {})
    dropped = sum(e["duplicates_dropped"] for e in sources)
    if dropped:
        skipped["duplicate_across_datasets"] = dropped
    stats = {
        **{k: v for k, v in first.items() if k not in ("from_prepared", "sources", "mixture")},
        "input": [e["input"] for e in sources],
        "max_length": max(int(st.get("max_length") or 0) for _, st in parts),
        "records_read": sum(int(st.get("records_read") or 0) for _, st in parts),
        "conversations_kept": sum(int(st.get("conversations_kept") or 0) for _, st in parts),
        "skipped": dict(sorted(skipped.items())),
        "skipped_total": int(sum(skipped.values())),
        "skipped_examples": {
            k: [x for _, st in parts for x in (st.get("skipped_examples") or {}).get(k, [])][:3]
            for k in sorted({k for _, st in parts for k in st.get("skipped_examples") or {}})
        },
        "warnings": [w for _, st in parts for w in st.get("warnings") or []],
        **{k: sum(int(st.get(k) or 0) for _, st in parts) for k in _SUMMED},
        "conversation_token_percentiles": None,  # each dataset's are in its own stats
        "tokens_total": sum(v["tokens"] for v in per_split.values()),
        "trainable_tokens_total": sum(v["trainable_tokens"] for v in per_split.values()),
        "splits": per_split,
        "max_token_id": max_id,
        "merged_from": sources,
    }
    return dd, stats


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
    aux = tuple(cfg.cache_aux_layers) if cfg.cache_aux_layers else None
    work = chunk_dir(partial, dd, cfg.base, cfg.cache_batch_size, aux)
    regen = _regen_states(cfg, partial)
    cache_hidden_states(dd, cfg.base, cfg.cache_batch_size, device, work, ranks, aux, regen)
    return {"rank": ranks.rank, "world": ranks.world, "seconds": time.perf_counter() - t0}


def _keeps_states(cfg: PrepConfig) -> bool:
    """Whether regeneration keeps its states for caching to take (regen.keep_states): a prep
    that regenerates (not from_prepared) with cache_hidden=true, but not with cache_aux_layers
    (which the states do not hold)."""
    return (
        cfg.regenerate
        and cfg.cache_hidden
        and cfg.regen.keep_states
        and not cfg.cache_aux_layers
        and not cfg.prepared_sources()
    )


def _regen_states(cfg: PrepConfig, partial: Path):
    """The states this prep's regeneration kept, for caching to take."""
    from data_prep.hidden import RegenStates

    return RegenStates(partial / "regen") if _keeps_states(cfg) else None


def _regen_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _split_stats(dd) -> tuple[dict[str, dict], int]:
    """Each split's sample and token counts and length percentiles, and the largest token id."""
    per_split = {}
    max_id = 0
    for split, part in dd.items():
        lengths = column_array(part, "length")
        per_split[split] = {
            "samples": len(part),
            "tokens": int(lengths.sum()),
            "trainable_tokens": int(column_array(part, "num_trainable").sum()),
            "length_percentiles": _percentiles(lengths),
        }
        for ids in part.with_format("arrow").select_columns(["input_ids"]).iter(BATCH_ROWS):
            top = pc.max(ids.column("input_ids").combine_chunks().flatten()).as_py()
            max_id = max(max_id, int(top or 0))
    return per_split, max_id


def _ids_stats(kept) -> dict[str, Any]:
    """regen.token_ids: how many kept conversations are the tokens their last regenerated turn
    ran over, and how many kept their text's tokens, by reason (template.generated_encoding;
    none: no ids were recorded, from a server, a shard written before they were, or a template
    that renders the history otherwise once a reply follows)."""
    got: Counter = Counter()
    for b in iter_batches(kept, ["piece", "ids_from"]):
        got.update(f for p, f in zip(b["piece"], b["ids_from"], strict=True) if p == 0)
    text = {k.removeprefix("text:"): n for k, n in sorted(got.items()) if k.startswith("text:")}
    return {"generated": got.get("generated", 0), "text": text}


def _stats(cfg, read_info, skips: SkipLog, kept, dd, conv_lengths, tokenizer) -> dict:
    from train.core.base import tokenizer_fingerprint

    per_split, max_id = _split_stats(dd)
    pieces = column_array(kept, "piece")
    return {
        "input": read_info["input"],
        "base": cfg.base.name,
        "records_read": read_info["records_read"],
        "skip_records": cfg.data.skip_records,
        "conversations_kept": int((pieces == 0).sum()),
        "skipped": dict(sorted(skips.counts.items())),
        "skipped_total": int(sum(skips.counts.values())),
        "skipped_examples": skips.examples,
        "warnings": skips.warnings,
        "leading_assistant_turns_dropped": read_info["leading_assistant_turns_dropped"],
        "trailing_user_turns_dropped": read_info["trailing_user_turns_dropped"],
        "conversations_split": int((pieces == 1).sum()),
        "conversations_over_max_length": int((conv_lengths > cfg.data.max_length).sum()),
        "conversation_token_percentiles": _percentiles(conv_lengths),
        "max_length": cfg.data.max_length,
        "long_conversations": cfg.data.long_conversations,
        "packed": cfg.data.pack,
        "regenerated": cfg.regenerate,
        **({"regen_token_ids": _ids_stats(kept)} if cfg.regenerate and cfg.regen.token_ids else {}),
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
        "tokenizer": tokenizer_fingerprint(tokenizer),  # train and eval: the same vocabulary
        # a mixture (data.sources): its totals, and each source's counts by name; regenerate:
        # its turns, reply tokens, generation time and throughput
        **{k: read_info[k] for k in ("mixture", "sources", "regeneration") if k in read_info},
    }
