"""Offline mode: run the frozen base once over prepared samples and store its hidden states.

The work is cut into chunks of whole batches (samples sorted by length, so a batch wastes
little compute on padding). Each chunk is saved on its own under `work` as it finishes, so a
killed prep resumes from the chunks it has, and the chunks spread over the processes of a
launcher (`torchrun --nproc_per_node=N --no-python hydra-heads prep ...`, or `srun -n N`):
the chunks of every split are shared out by their cost (the padded tokens their batches run),
costliest first, each to the rank with the least work so far, so the ranks finish as evenly as
whole chunks allow; every rank computes the same shares from the data alone, with no
communication, and rank 0 puts the chunks together. A batch holds the same samples whatever
the number of processes, so N processes give one process's dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_prep.spool import column_array
from train.core.atomic import staged_dir
from train.core.base import BaseConfig, load_base

AUX = "aux_hidden"  # the column of EAGLE-3's fused layers (prep cache_aux_layers=[...])
# Batches per saved chunk, the unit of resumption and of sharing out: as many as make at most
# CHUNKS_PER_SPLIT chunks of a split, within these bounds. A small split gets small chunks, so
# the ranks' shares come out even (16 batches a chunk gave 175 samples 4 chunks, 3 of them, 59%
# of the padded tokens, to one of two ranks); a large one keeps few enough chunk dirs to put
# together quickly (each is a dataset of its own).
CHUNK_BATCHES = (4, 16)
CHUNKS_PER_SPLIT = 256
CHUNK_LAYOUT = 2  # in the chunk dir's key: chunks cut another way are never reused
WAIT_POLL_S = 0.5


@dataclass(frozen=True)
class Ranks:
    """This process's place among the launcher's: (rank, world size, local rank)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, else an srun step's SLURM_PROCID /
        SLURM_STEP_NUM_TASKS / SLURM_LOCALID, else one process. (An sbatch script itself, outside
        srun, has SLURM_NTASKS of its allocation but is one process: no STEP_NUM_TASKS there.)"""
        env = os.environ
        if "WORLD_SIZE" in env:
            keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
            keys = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")
        else:
            return cls()
        rank, world, local = (int(env.get(k, 0)) for k in keys)
        return cls(rank, max(world, 1), local)


def rank_device(device: str, ranks: Ranks) -> str:
    """The device a rank caches on: with several ranks on `cuda`, the local rank's GPU among
    those it sees (all of the node's: `srun --gpus-per-node`, torchrun), or the one it sees
    (`srun --gpus-per-task=1` binds each task to its own)."""
    if device != "cuda" or ranks.world == 1:
        return device
    seen = torch.cuda.device_count()
    return f"cuda:{ranks.local % seen}" if seen > 1 else "cuda"


def chunk_batches(samples: int, batch_size: int) -> int:
    """Batches per chunk of a split of `samples`: at most CHUNKS_PER_SPLIT chunks, within
    CHUNK_BATCHES."""
    batches = -(-samples // batch_size)
    low, high = CHUNK_BATCHES
    return min(high, max(low, -(-batches // CHUNKS_PER_SPLIT)))


def _chunks(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Sample indices of each chunk: the length-sorted order cut into chunk_batches() batches."""
    order = np.argsort(lengths, kind="stable")
    per = batch_size * chunk_batches(len(order), batch_size)
    return [order[i : i + per] for i in range(0, len(order), per)]


def padded_tokens(lengths: np.ndarray, idx: np.ndarray, batch_size: int) -> int:
    """What a chunk costs: the tokens its batches run, padding included (rows x longest row)."""
    rows = np.asarray(lengths)[idx]
    return sum(
        len(b) * int(b.max())
        for b in (rows[i : i + batch_size] for i in range(0, len(rows), batch_size))
    )


def shares(costs: list[int], world: int) -> list[int]:
    """Each chunk's rank: costliest chunk first, each to the rank with the least work so far
    (ties: the lower rank, then the lower chunk), so every rank computes the same shares."""
    load = [0] * world
    owner = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[j] = r
        load[r] += costs[j]
    return owner


def save_regen_states(
    path: Path, kept: list[tuple[str, np.ndarray, np.ndarray]], dtype: str = "float32"
) -> None:
    """Regeneration's states of one shard: each conversation's (key, token ids (n,), float16
    hidden states (n, H)), as three arrays in `path` (written whole or not at all), with the
    dtype the base computed them in."""
    with staged_dir(path) as tmp:
        (tmp / "meta.json").write_text(json.dumps({"dtype": dtype}))
        np.save(tmp / "ids.npy", np.concatenate([ids for _, ids, _ in kept]).astype(np.int32))
        np.save(tmp / "hidden.npy", np.concatenate([h for _, _, h in kept]).astype(np.float16))
        np.save(tmp / "lengths.npy", np.asarray([len(ids) for _, ids, _ in kept], np.int64))


class RegenStates:
    """The hidden states regeneration computed (prep regenerate=true cache_hidden=true), for
    caching to take instead of running the base again over a sample of those tokens.

    A sample takes them when its tokens are a regenerated conversation's or their start (a
    sample cut at data.max_length, the first piece of a split one): with causal attention a
    prefix's states are the whole's. Any other sample (a chat template that renders a reply
    otherwise, a reply whose text tokenizes anew differently, a later piece of a split
    conversation, a packed row) is computed as before. The arrays are memory-mapped, so
    memory stays flat.
    """

    KEY = 48  # a conversation is indexed by its first KEY tokens (a system prompt and more)

    def __init__(self, regen_dir: Path, dtype: str | None = None):
        """Every shard's states under `regen_dir`; with `dtype`, only those the base computed
        in that dtype (restrict)."""
        self.parts: list[tuple[np.ndarray, np.ndarray]] = []
        self.dtypes: list[str] = []  # each part's
        self.index: dict[bytes, list[tuple[int, int, int]]] = {}  # key -> (part, start, n)
        for d in sorted(Path(regen_dir).glob("states-*")):
            if not (d / "lengths.npy").is_file() or not (d / "meta.json").is_file():
                continue  # not states written whole by this release
            ids = np.load(d / "ids.npy", mmap_mode="r")
            hidden = np.load(d / "hidden.npy", mmap_mode="r")
            part = len(self.parts)
            self.parts.append((ids, hidden))
            self.dtypes.append(json.loads((d / "meta.json").read_text())["dtype"])
            start = 0
            for n in np.load(d / "lengths.npy").tolist():
                key = _digest(ids[start : start + min(n, self.KEY)])
                self.index.setdefault(key, []).append((part, start, n))
                start += n
        self.taken_samples = 0  # set by cache_hidden_states: every rank's samples that took them
        if dtype is not None:
            self.restrict(dtype)

    @property
    def hidden_size(self) -> int | None:
        """The width of the states served (None: none)."""
        used = {part for entries in self.index.values() for part, _, _ in entries}
        return int(self.parts[min(used)][1].shape[1]) if used else None

    def restrict(self, dtype: str) -> None:
        """Serve only the states computed in `dtype` (a run resumed with another `base.dtype`
        has the older shards' samples cached by the base)."""
        self.index = {
            key: kept
            for key, entries in self.index.items()
            if (kept := [e for e in entries if self.dtypes[e[0]] == dtype])
        }

    def __len__(self) -> int:
        return sum(len(v) for v in self.index.values())

    def find(self, ids) -> tuple[int, int] | None:
        """Where the states of a sample of these tokens are: (part, start), or None."""
        ids = np.asarray(ids, dtype=np.int32)
        for part, start, n in self.index.get(_digest(ids[: self.KEY]), ()):
            if n >= len(ids) and np.array_equal(self.parts[part][0][start : start + len(ids)], ids):
                return part, start
        return None

    def states(self, hit: tuple[int, int], n: int) -> np.ndarray:
        """The states (n, H) at `hit` (find's answer for a sample of n tokens)."""
        part, start = hit
        return np.asarray(self.parts[part][1][start : start + n])

    def lookup(self, ids) -> np.ndarray | None:
        """The states (len(ids), H) of a sample of these tokens, or None."""
        hit = self.find(ids)
        return None if hit is None else self.states(hit, len(ids))


def dtype_name(model) -> str:
    """The dtype a model computes in, as its states record it ("float32")."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).digest()


def _forward(base, ids_list: list, device: str, aux_layers: tuple[int, ...] | None):
    """The base over a batch: each sample's last hidden state (T, H), and with `aux_layers` its
    hidden states at those indices concatenated (T, n H), fp16."""
    pad = base.tokenizer.pad_token_id or 0
    T = max(len(x) for x in ids_list)
    ids = torch.full((len(ids_list), T), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, x in enumerate(ids_list):
        ids[i, : len(x)] = torch.as_tensor(np.asarray(x))
        attn[i, : len(x)] = 1
    out = base.model.model(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        use_cache=False,
        output_hidden_states=bool(aux_layers),
    )
    cols = [out.last_hidden_state]
    if aux_layers:  # EAGLE-3's fused layers, as train/decoding/backend.head_features reads them
        cols.append(torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1))
    arrays = [c.float().cpu().numpy().astype(np.float16) for c in cols]
    return [tuple(a[i, : len(x)] for a in arrays) for i, x in enumerate(ids_list)]


def _features(H: int, aux_layers: tuple[int, ...] | None):
    from datasets import Array2D

    feats = {"hidden": Array2D(shape=(None, H), dtype="float16")}
    if aux_layers:
        feats[AUX] = Array2D(shape=(None, len(aux_layers) * H), dtype="float16")
    return feats


def _save_chunk(path: Path, rows: list[tuple], H: int, aux_layers) -> None:
    from datasets import Dataset, Features

    feats = _features(H, aux_layers)
    cols = {name: [r[j] for r in rows] for j, name in enumerate(feats)}
    # a chunk dir exists only when complete; a bar per chunk would bury the caching bar
    with staged_dir(path) as tmp, _quiet_datasets():
        Dataset.from_dict(cols, features=Features(feats)).save_to_disk(str(tmp))


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


@torch.no_grad()
def cache_hidden_states(
    dd,
    base_cfg: BaseConfig,
    batch_size: int,
    device: str,
    work: Path,
    ranks: Ranks = Ranks(),
    aux_layers: tuple[int, ...] | None = None,
    regen: RegenStates | None = None,
):
    """Add a `hidden` column (T, H) fp16: the base's last (post-norm) hidden state per token;
    with `aux_layers`, an `aux_hidden` column (T, n H) too: the hidden states at those indices of
    transformers' `hidden_states` (i: the input of layer i), concatenated (head=eagle3).

    Training reads it instead of running the base (`data.offline=true`); the teacher logits are
    that state through the frozen lm_head, so they match online training up to fp16 rounding.
    Computes this rank's chunks into `work/<split>/` (skipping those already there); rank 0
    then waits for every chunk and returns the DatasetDict, the others return None.

    `regen`: the states regeneration computed; a sample they cover takes them and the base
    runs over the others only (not with `aux_layers`, which regeneration does not keep).
    """
    from tqdm.auto import tqdm  # as regeneration: its updates reach a log file too (rich's not)

    base = load_base(base_cfg, device=rank_device(device, ranks))
    H = base.hidden_size
    lengths = {split: column_array(dd[split], "length") for split in sorted(dd)}
    plan = {split: _chunks(lengths[split], batch_size) for split in sorted(dd)}
    jobs = [(split, c, idx) for split, chunks in plan.items() for c, idx in enumerate(chunks)]
    if regen is not None:  # those computed in the dtype caching runs in, of the same width
        regen.restrict(dtype_name(base.model))
        regen = None if aux_layers or regen.hidden_size not in (None, H) else regen
    # samples that take regeneration's states cost nothing: the shares count the others
    hits = [_hits(regen, dd[split], idx) for split, _, idx in jobs]
    taken = [np.asarray([h is not None for h in hs], dtype=bool) for hs in hits]
    if regen is not None:
        regen.taken_samples = int(sum(t.sum() for t in taken))
    costs = [
        padded_tokens(lengths[split], idx[~t], batch_size)
        for (split, _, idx), t in zip(jobs, taken, strict=True)
    ]
    owner = shares(costs, ranks.world)
    if ranks.world > 1:
        mine = sum(c for c, r in zip(costs, owner, strict=True) if r == ranks.rank)
        print(
            f"rank {ranks.rank}/{ranks.world}: {owner.count(ranks.rank)} of {len(jobs)} "
            f"hidden-state chunks, {mine / max(sum(costs), 1):.1%} of the padded tokens"
        )
    todo = [
        (split, c, idx, hs, t)
        for (split, c, idx), hs, t, r in zip(jobs, hits, taken, owner, strict=True)
        if r == ranks.rank and not (work / split / f"chunk-{c:05d}").is_dir()
    ]
    label = "caching hidden states" + (f" (rank {ranks.rank}/{ranks.world})" * (ranks.world > 1))
    with tqdm(total=sum(len(idx) for _, _, idx, _, _ in todo), desc=label, unit="sample") as bar:
        for split, c, idx, hs, t in todo:
            n = lengths[split][idx]  # each sample's tokens
            rows: list = [
                None if h is None else (regen.states(h, int(k)),)
                for h, k in zip(hs, n, strict=True)
            ]
            bar.update(int(t.sum()))
            run = np.flatnonzero(~t)  # in length order, as before
            ids = dd[split].select(idx[run])["input_ids"]  # only the samples the base runs over
            for i in range(0, len(run), batch_size):
                got = _forward(base, ids[i : i + batch_size], device, aux_layers)
                for j, r in zip(run[i : i + batch_size], got, strict=True):
                    rows[j] = r
                bar.update(len(got))
            (work / split).mkdir(parents=True, exist_ok=True)
            _save_chunk(work / split / f"chunk-{c:05d}", rows, H, aux_layers)
    if regen is not None:
        who = f"rank {ranks.rank}/{ranks.world}: " if ranks.world > 1 else ""
        mine = [t for t, r in zip(taken, owner, strict=True) if r == ranks.rank]
        n = sum(len(t) for t in mine)
        print(
            f"{who}hidden states of {sum(int(t.sum()) for t in mine)} of {n} samples taken "
            "from regeneration"
        )
    if ranks.rank != 0:
        return None
    _wait_for_chunks(work, plan)
    return _assemble(dd, plan, work, H, aux_layers)


def _hits(regen: RegenStates | None, ds, idx: np.ndarray) -> list[tuple[int, int] | None]:
    """Where regeneration's states of each sample of a chunk are (RegenStates.find), in chunk
    order: None for a sample the base runs over."""
    if regen is None or len(regen) == 0:
        return [None] * len(idx)
    return [regen.find(x) for x in ds.select(idx)["input_ids"]]


def _wait_for_chunks(work: Path, plan: dict[str, list]) -> None:
    """Rank 0: until every rank's chunks are saved (a rank that dies is the launcher's to stop:
    torchrun and srun --kill-on-bad-exit end the others)."""
    need = [work / s / f"chunk-{c:05d}" for s, chunks in plan.items() for c in range(len(chunks))]
    shown = 0.0
    while missing := [p for p in need if not p.is_dir()]:
        if time.time() - shown > 30:
            print(f"waiting for {len(missing)} hidden-state chunk(s) from the other ranks")
            shown = time.time()
        time.sleep(WAIT_POLL_S)


def _assemble(dd, plan: dict[str, list], work: Path, H: int, aux_layers=None):
    """Every split with its chunks' states as the `hidden` (and `aux_hidden`) columns, in the
    split's own order."""
    from datasets import Dataset, DatasetDict, concatenate_datasets, load_from_disk

    out = {}
    for split, ds in dd.items():
        feats = ds.features.copy()
        feats.update(_features(H, aux_layers))
        if len(ds) == 0:
            out[split] = Dataset.from_dict({k: [] for k in feats}, features=feats)
            continue
        chunks = [
            load_from_disk(str(work / split / f"chunk-{c:05d}")) for c in range(len(plan[split]))
        ]
        order = np.concatenate(plan[split])
        hidden = concatenate_datasets(chunks).select(np.argsort(order, kind="stable"))
        with _quiet_datasets():  # a side-by-side concatenation takes no index map
            hidden = hidden.flatten_indices()
        out[split] = concatenate_datasets([ds, hidden], axis=1)
    return DatasetDict(out)


def chunk_dir(partial: Path, dd, base_cfg: BaseConfig, batch_size: int, aux_layers=None) -> Path:
    """Where a prep's chunks live: keyed by its samples (each split's tokens), base, batch size,
    chunk layout and fused layers, so that a prep of other data or another base never reuses them
    (nor one whose chunks were cut otherwise)."""
    key = [base_cfg.name, batch_size, sorted(dd)] + ([list(aux_layers)] if aux_layers else [])
    key.append({"chunk_layout": CHUNK_LAYOUT})
    h = hashlib.sha256(json.dumps(key).encode())
    for split in sorted(dd):
        col = dd[split].data.column("input_ids").combine_chunks()
        h.update(np.asarray(col.offsets).tobytes())
        h.update(np.asarray(col.flatten()).tobytes())
    return partial / f"hidden-{h.hexdigest()[:16]}"
