"""Training data: read `prep` output, length-bucketed batches per rank, padding, resumable order."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from train.config import TrainDataConfig
from train.core.errors import UserError

REQUIRED_COLUMNS = ("input_ids", "loss_mask", "length", "seq_lens")
# What Lightning warns on a mid-epoch resume unless the DataLoader has state_dict /
# load_state_dict. Ours needs neither: `PreparedDataModule.train_dataloader` puts the sampler
# at the exact batch the restored step count says (`resume_position`), so the warning is false.
NOT_RESUMABLE_WARNING = (
    "You're resuming from a checkpoint that ended before the epoch ended and your dataloader "
    "is not resumable"
)

log = logging.getLogger(__name__)


class PreparedDataError(UserError, RuntimeError):
    """data.prepared does not point at a complete, compatible `hydra-heads prep` output."""


def _rerun_prep(p: Path) -> str:
    return f"re-run `hydra-heads prep ... out={p}` (with the data and base it was made for)"


def _read_json(path: Path, p: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedDataError(
            f"data.prepared={p} is damaged: {path.name} cannot be read ({e}); {_rerun_prep(p)}"
        ) from None


def check_prepared(path: str | Path, offline: bool = False) -> dict[str, Any]:
    """Check, without reading any Arrow data, that `path` is a complete `prep` output with a
    train split holding the columns training needs; return its prep_stats.json.

    Cheap (a few small JSON files), so it runs before the base model loads: a wrong path
    fails in a fraction of a second, not after the seconds (or minutes) a base takes."""
    p = Path(path).expanduser()
    if not p.exists():
        raise PreparedDataError(
            f"data.prepared={p} does not exist; create it with `hydra-heads prep ... out={p}`"
        )
    if not p.is_dir():
        raise PreparedDataError(
            f"data.prepared={p} is a file, not the out= dir of `hydra-heads prep`"
        )
    missing = [n for n in ("prep_stats.json", "dataset_dict.json") if not (p / n).is_file()]
    if missing:
        raise PreparedDataError(
            f"data.prepared={p} is not a complete `hydra-heads prep` output (no "
            f"{' or '.join(missing)}; an interrupted prep never publishes one); {_rerun_prep(p)}"
        )
    stats = _read_json(p / "prep_stats.json", p)
    splits = _read_json(p / "dataset_dict.json", p)
    splits = splits.get("splits") if isinstance(splits, dict) else None
    if not isinstance(stats, dict) or not isinstance(splits, list):
        raise PreparedDataError(
            f"data.prepared={p} is damaged: prep_stats.json or dataset_dict.json is not what "
            f"prep writes; {_rerun_prep(p)}"
        )
    if "train" not in splits:
        raise PreparedDataError(f"data.prepared={p} has no train split ({splits})")
    for split in splits:
        for name in ("state.json", "dataset_info.json"):
            if not (p / str(split) / name).is_file():
                raise PreparedDataError(
                    f"data.prepared={p} is damaged: {split}/{name} is missing; {_rerun_prep(p)}"
                )
    info = _read_json(p / "train" / "dataset_info.json", p)
    columns = list((info.get("features") or {}) if isinstance(info, dict) else {})
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise PreparedDataError(f"data.prepared={p} lacks columns {missing}; {_rerun_prep(p)}")
    if offline and "hidden" not in columns:
        raise PreparedDataError(
            f"data.offline=true needs cached hidden states, but {p} has none; prepare with "
            "`hydra-heads prep cache_hidden=true ...` or set data.offline=false"
        )
    return stats


def check_vocab(path: str | Path, vocab_size: int) -> None:
    """Refuse data whose largest token id does not fit the base's vocab (another tokenizer)."""
    p = Path(path).expanduser()
    stats = _read_json(p / "prep_stats.json", p)
    top = stats.get("max_token_id") if isinstance(stats, dict) else None
    if top is not None and top >= vocab_size:
        raise PreparedDataError(
            f"data.prepared={p} holds token id {top} but the base vocab has {vocab_size} "
            f"tokens: it was prepared for another tokenizer (base={stats.get('base')})"
        )


def check_aux_layers(path: str | Path, layers: tuple[int, ...]) -> None:
    """Offline head=eagle3: the prepared data must hold exactly its fused layers."""
    p = Path(path).expanduser()
    stats = _read_json(p / "prep_stats.json", p)
    cached = stats.get("cached_aux_layers") if isinstance(stats, dict) else None
    if cached is None or [int(i) for i in cached] != list(layers):
        have = "none" if cached is None else str(list(cached))
        raise PreparedDataError(
            f"data.offline=true with head=eagle3 needs the base's layers {list(layers)} cached, "
            f"but data.prepared={p} holds {have}; cache them from its samples with `hydra-heads "
            f"prep from_prepared={p} base={stats.get('base')} cache_hidden=true "
            f"'cache_aux_layers={list(layers)}' out=NEW_DIR`, or set data.offline=false"
        )


def load_prepared(path: str | Path, vocab_size: int | None = None, offline: bool = False):
    """The DatasetDict written by `prep`, checked to be complete and to fit the base's vocab
    (when `vocab_size` is given)."""
    import datasets

    p = Path(path).expanduser()
    check_prepared(p, offline)
    try:
        dd = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001 - any damage in the Arrow files: one clear message
        raise PreparedDataError(
            f"data.prepared={p} is damaged and cannot be loaded ({type(e).__name__}: {e}); "
            f"{_rerun_prep(p)}"
        ) from None
    if vocab_size is not None:
        check_vocab(p, vocab_size)
    return dd


def token_counts(ds, vocab_size: int) -> torch.Tensor:
    """How often each token is a training target (loss_mask == 1) in `ds`."""
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy()
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().astype(bool)
    return torch.from_numpy(np.bincount(ids[mask], minlength=vocab_size)[:vocab_size])


class BucketBatchSampler(Sampler[list[int]]):
    """Seeded batches of similar-length samples; each rank takes its own share of batches.

    Per epoch: shuffle (seed + epoch), cut into buckets of `bucket_batches` batches, sort each
    bucket by length, cut into batches, shuffle the batch order, then rank r takes batches
    r, r + world, ... (all ranks get the same count). A resumed run calls `resume_at`: its
    next iteration is that epoch without its first `skip` batches, whatever `set_epoch` said
    meanwhile (the epoch Lightning counts on resume can be one ahead; see `resume_position`).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        bucket_batches: int = 32,
        rank: int = 0,
        world: int = 1,
    ):
        self.lengths = np.asarray(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.bucket = bucket_batches * batch_size
        self.rank, self.world = rank, world
        self.epoch = 0
        self.skip = 0
        self._resume_epoch: int | None = None
        if len(self._all_batches(0)) < world:
            raise PreparedDataError(
                f"{len(self.lengths)} samples make fewer batches of {batch_size} than there are "
                f"processes ({world}); lower data.batch_size or prepare more data"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, skip: int) -> None:
        """Make the next iteration epoch `epoch` from its batch `skip` on (a resumed run)."""
        self.epoch, self.skip, self._resume_epoch = epoch, skip, epoch

    def _all_batches(self, epoch: int) -> list[np.ndarray]:
        n = len(self.lengths)
        rng = np.random.default_rng([self.seed, epoch])
        idx = rng.permutation(n) if self.shuffle else np.arange(n)
        batches = []
        for a in range(0, n, self.bucket):
            part = idx[a : a + self.bucket]
            part = part[np.argsort(self.lengths[part], kind="stable")]
            batches += [part[i : i + self.batch_size] for i in range(0, len(part), self.batch_size)]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def __len__(self) -> int:
        return len(self._all_batches(0)) // self.world

    def __iter__(self):
        per = len(self)
        if self._resume_epoch is not None:
            self.epoch, self._resume_epoch = self._resume_epoch, None
        mine = self._all_batches(self.epoch)[self.rank :: self.world][:per]
        skip, self.skip = self.skip, 0
        for b in mine[skip:]:
            yield b.tolist()


def epoch_batches(sampler_batches: int, limit: int | float | None = None) -> int:
    """Training batches per epoch per rank, as Lightning counts them (`limit_train_batches`)."""
    if isinstance(limit, int):  # an int counts batches; a float is a fraction of the epoch
        return min(sampler_batches, limit)
    return sampler_batches if limit is None else int(sampler_batches * limit)


def resume_position(steps: int, epoch_batches: int, accumulate: int = 1) -> tuple[int, int]:
    """(epoch, batches of it already trained on) after `steps` optimizer steps.

    Derived from the steps alone, never from the epoch counter a checkpoint holds: Lightning
    checkpoints at the last batch of an epoch (on_train_batch_end) before it advances its
    epoch counter, so that counter says "epoch 0" for a position that is really the start of
    epoch 1. The last step of an epoch may accumulate fewer batches (Lightning steps the
    optimizer at every epoch's end), so an epoch is ceil(batches / accumulate) steps.
    """
    steps_per_epoch = max(1, math.ceil(epoch_batches / accumulate))
    epoch, step_in_epoch = divmod(steps, steps_per_epoch)
    return epoch, step_in_epoch * accumulate


STATE_COLUMNS = ("hidden", "aux_hidden")  # cached base states (prep cache_hidden=true)


CROPS = ("start", "supervised")  # which max_length window of a longer sample is trained on


def window_start(loss_mask: np.ndarray, n: int) -> int:
    """Start of the n-token window of a sample that holds the most loss tokens (the earliest of
    equal windows; 0 when the sample fits)."""
    if len(loss_mask) <= n:
        return 0
    cs = np.concatenate(([0], np.cumsum(np.asarray(loss_mask) > 0)))
    return int(np.argmax(cs[n:] - cs[:-n]))


def collate(cols: dict[str, Any], pad_id: int, max_length: int | None, crop: str = "start") -> dict:
    """Right-padded tensors: input_ids, attention_mask, loss_mask, segment_ids (+ the cached
    states: hidden, and EAGLE-3's fused layers as aux_hidden).

    cols: a batch of rows as columns (what `datasets` returns for a list of indices).
    crop: a sample longer than max_length keeps its first max_length tokens ("start"), or the
    window of max_length tokens with the most loss tokens ("supervised"; cached states are cut
    from the same window).
    """
    if crop not in CROPS:
        raise ValueError(f"crop={crop!r}: expected one of {', '.join(CROPS)}")
    ids_rows = cols["input_ids"]
    lens = [min(len(x), max_length or 1 << 30) for x in ids_rows]
    starts = [
        window_start(cols["loss_mask"][i], n) if crop == "supervised" else 0
        for i, n in enumerate(lens)
    ]
    T, B = max(lens), len(ids_rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    lmask = torch.zeros((B, T), dtype=torch.bool)
    seg = torch.full((B, T), -1, dtype=torch.long)
    states = {
        c: torch.zeros((B, T, np.asarray(cols[c][0]).shape[-1])) for c in STATE_COLUMNS if c in cols
    }
    for i, (n, a) in enumerate(zip(lens, starts, strict=True)):
        ids[i, :n] = torch.from_numpy(np.asarray(ids_rows[i][a : a + n], dtype=np.int64))
        attn[i, :n] = 1
        lmask[i, :n] = torch.from_numpy(np.asarray(cols["loss_mask"][i][a : a + n]) > 0)
        seg_lens = np.asarray(cols["seq_lens"][i])
        seg[i, :n] = torch.from_numpy(np.repeat(np.arange(len(seg_lens)), seg_lens)[a : a + n])
        for c, t in states.items():
            t[i, :n] = torch.from_numpy(np.asarray(cols[c][i][a : a + n], dtype=np.float32))
    out = {"input_ids": ids, "attention_mask": attn, "loss_mask": lmask, "segment_ids": seg}
    return {**out, **states}


class _Batches(torch.utils.data.Dataset):
    """A datasets.Dataset read one whole batch of indices at a time (one Arrow take per batch)."""

    def __init__(
        self,
        ds,
        pad_id: int,
        max_length: int | None,
        with_hidden: bool | str = False,
        crop: str = "start",
    ):
        cols = ["input_ids", "loss_mask", "seq_lens"]
        if with_hidden:  # the last hidden state, and EAGLE-3's fused layers when they are read
            cols += ["hidden"] + (["aux_hidden"] if with_hidden == "aux" else [])
        self.ds = ds.with_format("numpy", columns=cols)
        self.pad_id, self.max_length, self.crop = pad_id, max_length, crop

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, indices: list[int]) -> dict:
        return collate(self.ds[indices], self.pad_id, self.max_length, self.crop)


def train_subset(ds, n: int | None, seed: int):
    """`data.max_train_samples`: n training samples drawn at random with `seed` (kept in their
    prepared order), or all of them. The same n and seed give the same samples, so a resumed run
    and the draft vocab see what training sees."""
    if n is None or n >= len(ds):
        return ds
    keep = np.random.default_rng([seed, n]).permutation(len(ds))[:n]
    return ds.select(np.sort(keep).tolist())


class PreparedDataModule(pl.LightningDataModule):
    """Serves `prep` output to Lightning: length-bucketed, padded, deterministic, resumable."""

    def __init__(
        self, cfg: TrainDataConfig, pad_id: int, seed: int, vocab_size: int, aux: bool = False
    ):
        """`aux`: offline batches carry the cached fused layers too (head=eagle3)."""
        super().__init__()
        self.cfg = cfg
        self.aux = aux
        self.pad_id = pad_id
        self.seed = seed
        self.vocab_size = vocab_size
        self.dd = None

    def setup(self, stage: str | None = None) -> None:
        if self.dd is None:
            self.dd = load_prepared(self.cfg.prepared, self.vocab_size, self.cfg.offline)

    def _loader(self, ds, batch_sampler, val: bool = False) -> DataLoader:
        # The sampler yields whole batches of indices; batch_size=None hands each to _Batches.
        # Validation reads each sample from its start, as decoding does (data.crop shapes
        # training only), so runs with different crops are scored on the same tokens, and up to
        # data.val_max_length, so short training windows are scored on longer contexts.
        cut = self.cfg.val_max_length if val and self.cfg.val_max_length else self.cfg.max_length
        return DataLoader(
            _Batches(
                ds,
                self.pad_id,
                cut,
                with_hidden=self.cfg.offline and ("aux" if self.aux else True),
                crop="start" if val else self.cfg.crop,
            ),  # fmt: skip
            sampler=batch_sampler,
            batch_size=None,
            generator=torch.Generator().manual_seed(self.seed),  # leave the global RNG alone
            num_workers=self.cfg.num_workers,
            persistent_workers=self.cfg.num_workers > 0,
        )

    def _rank_world(self) -> tuple[int, int]:
        t = getattr(self, "trainer", None)
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def train_dataloader(self) -> DataLoader:
        self.setup()
        rank, world = self._rank_world()
        ds = train_subset(self.dd["train"], self.cfg.max_train_samples, self.seed)
        sampler = BucketBatchSampler(
            np.asarray(ds["length"]),
            self.cfg.batch_size,
            self.seed,
            self.cfg.shuffle,
            self.cfg.bucket_batches,
            rank,
            world,
        )
        t = getattr(self, "trainer", None)
        if t is not None and t.global_step > 0:
            # Resumed run: continue where the checkpoint's optimizer steps left the data.
            per_epoch = epoch_batches(len(sampler), t.limit_train_batches)
            epoch, skip = resume_position(t.global_step, per_epoch, t.accumulate_grad_batches)
            sampler.resume_at(epoch, skip)
            if rank == 0:
                log.info(
                    "resumed data position: step %d -> epoch %d from its batch %d of %d "
                    "(the batches and order of an uninterrupted run)",
                    t.global_step,
                    epoch,
                    skip,
                    per_epoch,
                )
        return self._loader(ds, sampler)

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        if "validation" not in self.dd or len(self.dd["validation"]) == 0:
            return []
        ds = self.dd["validation"]
        rank, world = self._rank_world()
        if self.cfg.max_val_samples is not None:
            ds = ds.select(range(min(len(ds), self.cfg.max_val_samples)))
        bs = self.cfg.val_batch_size or self.cfg.batch_size
        if math.ceil(len(ds) / bs) < world:
            return []
        sampler = BucketBatchSampler(
            np.asarray(ds["length"]), bs, self.seed, False, self.cfg.bucket_batches, rank, world
        )
        return self._loader(ds, sampler, val=True)
