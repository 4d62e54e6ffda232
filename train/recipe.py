"""`hydra-heads train`: setup -> fit -> export heads. The recipe behind the train subcommand."""

from __future__ import annotations

import logging
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar

from train.config import TrainConfig
from train.core.atomic import write_json, write_text
from train.core.base import DeferredBase, FrozenBase, load_base
from train.core.errors import AlreadyExists, NotFound
from train.core.hardware import cpu_has_bf16, resolve_precision
from train.core.prompts import check_prepared_base
from train.data import (
    NOT_RESUMABLE_WARNING,
    PreparedDataModule,
    check_aux_layers,
    check_prepared,
    check_vocab,
    load_prepared,
    token_counts,
    train_subset,
)
from train.heads import base_shape, build_heads, heads_meta, save_heads
from train.heads.blocks import top_tokens
from train.module import HeadsModule
from train.tau import measured_tau
from train.time_budget import StepsForTime

log = logging.getLogger(__name__)


def rewind_finished_epoch(checkpoint: dict) -> bool:
    """Make a checkpoint written after an epoch's last batch had finished look like the one
    ModelCheckpoint writes at that batch (its on_train_batch_end); True if it was changed.

    A SIGTERM noticed after the last batch of an epoch (Lightning raises it at the end of the
    batch or of the epoch) leaves that batch, and perhaps the epoch, counted as complete.
    Lightning restores such a state badly: iteration-based training always "restarts", so
    the next epoch begins with the old epoch's batch count and ends after one batch, and every
    epoch after it is off by one (other data order, other logged epoch). The batch-end state
    differs only in these counters, and Lightning resumes it exactly."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    batches = fit.get("epoch_loop.batch_progress")
    epochs = fit.get("epoch_progress")
    counters = fit.get("epoch_loop.state_dict")
    if not batches or not epochs or not counters or not batches.get("is_last_batch"):
        return False
    current = batches["current"]
    if current["completed"] == 0 or current["completed"] != current["processed"]:
        return False  # not a finished last batch (the batch-end state already)
    for t in (current, batches["total"]):
        t["completed"] -= 1
    counters["_batches_that_stepped"] -= 1  # Lightning counts it after on_train_batch_end
    for t in (epochs["current"], epochs["total"]):
        if t["processed"] == t["started"]:  # the epoch itself was closed too
            t["processed"] -= 1
            t["completed"] = min(t["completed"], t["processed"])
    return True


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar for a run budgeted in steps (max_epochs=-1): `Epoch N`
    without the `/-2` that Lightning derives from max_epochs=-1, and `step: n/max_steps`
    beside the metrics, the figure that says how far the run is."""

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # padded to the validation bar's description, as Lightning does (no flicker)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            items = {"step": f"{trainer.global_step}/{trainer.max_steps}", **items}
        return items


def use_step_progress_bar(trainer: pl.Trainer) -> bool:
    """Put a `StepProgressBar` in place of Lightning's default rich bar (not of a bar the user
    configured, nor where the progress bar is off); True if it was replaced."""
    bar = trainer.progress_bar_callback
    if type(bar) is not RichProgressBar:
        return False
    trainer.callbacks[trainer.callbacks.index(bar)] = StepProgressBar()
    return True


class LogProgress(pl.Callback):
    """A log line every `every_s` seconds of training: step, seconds a step, time left and the
    train loss. Where the console is not a terminal (a SLURM or nohup log file) the rich bar
    draws nothing until the run ends, so this is what such a log shows while it trains."""

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = self.last = time.perf_counter()
        self.step0 = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s or not trainer.is_global_zero:
            return
        self.last = now
        step, total = trainer.global_step, trainer.max_steps
        msg = f"step {step}/{total}" if total and total > 0 else f"step {step}"
        done = step - self.step0
        if done > 0:
            per = (now - self.t0) / done
            msg += f", {per:.2f} s a step"
            if total and total > step:
                msg += f", about {(total - step) * per / 60:.1f} min left"
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            msg += f", train/loss {float(loss):.3f}"
        log.info(msg)


class SaveOnInterrupt(pl.Callback):
    """On SIGTERM (preemption) or Ctrl-C, write last.ckpt so `resume=true` loses nothing.

    It also records the step of the last checkpoint anyone wrote (`saved_step`: Lightning
    calls every callback's on_save_checkpoint for each full, resumable save, periodic ones
    included), so the end of a run knows whether its last step is on disk."""

    def __init__(self, path: Path):
        self.path = path
        self.saved_step: int | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.saved_step = trainer.global_step

    def on_exception(self, trainer, pl_module, exception) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException | KeyboardInterrupt) and trainer.global_step:
            trainer.save_checkpoint(str(self.path))
            log.warning("interrupted at step %d: saved %s", trainer.global_step, self.path)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if rewind_finished_epoch(checkpoint):
            log.info("checkpoint written at an epoch's end: resuming from that batch's end")


def checkpoint_candidates(out: Path) -> list[Path]:
    """Resumable checkpoints of a run: periodic/last ones, and the ones Lightning writes on
    SLURM's pre-emption signal before requeueing the job (hpc_ckpt_N.ckpt)."""
    return [*(out / "checkpoints").glob("*.ckpt"), *out.glob("hpc_ckpt_*.ckpt")]


def resume_checkpoint(ckpt_dir: Path) -> Path:
    """The newest checkpoint in `ckpt_dir` that loads: a run killed while writing one (SIGKILL
    mid-save) leaves a truncated file, and the one before it is then the place to resume."""
    cands = checkpoint_candidates(ckpt_dir.parent)
    if not cands:
        raise NotFound(f"resume=true but {ckpt_dir} holds no checkpoint: nothing to resume")
    # Newest first (last.ckpt wins a tie with the step file written at the same step).
    for c in sorted(cands, key=lambda c: (c.stat().st_mtime, c.name == "last.ckpt"), reverse=True):
        if c.is_dir():  # DeepSpeed writes a directory per checkpoint, complete once `latest` is
            if (c / "latest").is_file():
                log.info("resuming from %s", c)
                return c
            log.warning("skipping incomplete DeepSpeed checkpoint %s", c)
            continue
        try:
            torch.load(c, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - a damaged file is skipped, loudly
            log.warning("skipping unreadable checkpoint %s (%s)", c, e)
            continue
        log.info("resuming from %s", c)
        return c
    raise NotFound(f"no readable checkpoint in {ckpt_dir}; cannot resume")


def build_module(
    cfg: TrainConfig, defer_base: bool = False
) -> tuple[HeadsModule, PreparedDataModule, dict, FrozenBase | DeferredBase]:
    """Base, data, draft vocab, heads and the LightningModule, from the typed config: (module,
    data module, the heads' metadata, the base).

    `defer_base`: the base weights are loaded later, in `HeadsModule.configure_model` under the
    strategy's sharding context (ZeRO-3); the heads start from the lm_head read from disk."""
    offline = cfg.data.offline
    dd = load_prepared(cfg.data.prepared, offline=offline)  # bad data fails before the base loads
    base = DeferredBase(cfg.base) if defer_base else load_base(cfg.base)
    check_vocab(cfg.data.prepared, base.vocab_size)
    hidden = base.hidden_size if offline else None
    check_prepared_base(cfg.data.prepared, base.tokenizer, "data.prepared", hidden)
    fp = base.fingerprint()
    draft_ids = None
    if cfg.head.draft_vocab_size is not None:
        n = min(cfg.head.draft_vocab_size, base.vocab_size)
        train = train_subset(dd["train"], cfg.data.max_train_samples, cfg.seed)
        draft_ids = top_tokens(token_counts(train, base.vocab_size), n)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        heads = build_heads(cfg.head, base_shape(base.config), base.output_weight(), draft_ids)
    if offline and isinstance(heads.features, tuple):  # EAGLE-3's fused layers, cached by prep
        check_aux_layers(cfg.data.prepared, heads.features)
    meta = heads_meta(heads, fp, cfg.base.to_dict())
    module = HeadsModule(
        heads,
        cfg.optim,
        cfg.head.loss,
        max_steps=cfg.trainer["max_steps"],
        base_model=None if offline or defer_base else base.model,
        teacher_weight=base.lm_head.weight if offline else None,
        embed_weight=base.embed_tokens.weight if offline else None,
        hidden_state_offset=cfg.head.hidden_state_offset,
        meta=meta,
        base_loader=base.load if defer_base else None,
        teacher_softcap=getattr(base.config, "final_logit_softcapping", None),
    )
    pad = base.tokenizer.pad_token_id
    aux = isinstance(heads.features, tuple)  # EAGLE-3's fused layers
    dm = PreparedDataModule(cfg.data, 0 if pad is None else pad, cfg.seed, base.vocab_size, aux)
    dm.dd = dd
    return module, dm, meta, base


def warn_slow_cpu_bf16(trainer: pl.Trainer) -> bool:
    """Warn (and return True) when bf16 autocast runs on a CPU without bf16 units: there its
    matmuls are several times slower than fp32; with them an offline step is ~2.3x faster."""
    on_cpu = trainer.strategy.root_device.type == "cpu"
    if not (on_cpu and "bf16" in str(trainer.precision)) or cpu_has_bf16():
        return False
    log.warning(
        "trainer.precision=%s on a CPU without bf16 units (AVX512-BF16 / AMX): training will "
        "be several times slower than with trainer.precision=32-true",
        trainer.precision,
    )
    return True


def make_trainer(cfg: TrainConfig, **kwargs: Any) -> pl.Trainer:
    """The Lightning Trainer of `cfg.trainer` (a checked `_target_` config) with `kwargs`;
    `trainer.precision=auto` resolved for this machine (train/core/hardware.py) and logged."""
    from hydra.utils import instantiate

    if "precision" not in kwargs and str(cfg.trainer.get("precision")) == "auto":
        precision, why = resolve_precision("auto", cfg.trainer.get("accelerator"))
        log.info("trainer.precision=auto -> %s (%s)", precision, why)
        kwargs["precision"] = precision
    return instantiate(cfg.trainer, **kwargs)


# Over 80 lines: the recipe is setup -> train -> cleanup in order, each step a few lines
# (torchtune's shape); split, its resume and cleanup paths would be harder to follow.
def fit(
    cfg: TrainConfig,
    make: Callable[..., pl.Trainer] | None = None,
    logger: Any = False,
    resolved_config: str | None = None,
) -> dict[str, Any]:
    """Train, checkpoint, export `<out>/heads`; return the summary also written to disk.

    `make(**kwargs)` builds the Trainer (default: from `cfg.trainer`); `logger` is a Lightning
    logger, a list of them, or False; `resolved_config` is written to `<out>/config.yaml`."""
    check_prepared(cfg.data.prepared, cfg.data.offline)  # before any heavy work
    out = Path(cfg.out).expanduser()
    ckpt_dir = out / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    resume = bool(checkpoint_candidates(out)) if cfg.resume == "auto" else cfg.resume
    resume_from = resume_checkpoint(ckpt_dir) if resume else None
    if not resume and checkpoint_candidates(out):
        raise AlreadyExists(
            f"{out} already holds checkpoints; pass resume=true to continue that run, or choose "
            "another out"
        )
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(
        dirpath=str(ckpt_dir),
        filename="step{step:06d}",
        every_n_train_steps=cfg.checkpoint_every,
        save_last=True,
        save_top_k=cfg.keep_checkpoints,
        monitor="step",
        mode="max",
        auto_insert_metric_name=False,
    )
    interrupt = SaveOnInterrupt(last)
    callbacks = [checkpoints, interrupt]
    budget = None
    if cfg.max_minutes is not None:  # before the Trainer, which puts ModelCheckpoint after it:
        # the checkpoint of the step that fixes the count then holds the count
        budget = StepsForTime(cfg.max_minutes, cfg.trainer["max_steps"], cfg.optim.warmup_steps)
        callbacks.append(budget)
    build = make or (lambda **kw: make_trainer(cfg, **kw))
    trainer = build(callbacks=callbacks, logger=logger, default_root_dir=str(out))
    use_step_progress_bar(trainer)
    if trainer.progress_bar_callback is not None and not sys.stdout.isatty():
        trainer.callbacks.append(LogProgress())  # a log file sees no rich bar until the end
    warn_slow_cpu_bf16(trainer)
    # Under ZeRO-3 a base bigger than one GPU (or one host's share) must be built already
    # partitioned: its loading waits for the strategy's zero.Init context (configure_model).
    defer = (
        bool(getattr(trainer.strategy, "zero_stage_3", False))
        and not cfg.data.offline
        and cfg.base.source != "tiny_random"
    )
    t0 = time.perf_counter()
    module, dm, meta, base = build_module(cfg, defer_base=defer)
    tau = measured_tau(
        cfg.val_tau,
        base,
        dm.dd.get("validation"),
        out,
        # heads_best records its training data too: eval's tree=auto calibrates on its
        # held-out rows, as it does for <out>/heads
        {**meta, "training": {"prepared": str(Path(cfg.data.prepared).resolve())}},
        cfg.head.hidden_state_offset,
        sharded=defer or bool(getattr(trainer.strategy, "zero_stage_3", False)),
    )
    if tau is not None:
        trainer.callbacks.append(tau)
    setup_s = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    if resolved_config is not None:
        write_text(out / "config.yaml", resolved_config)
    t1 = time.perf_counter()
    with warnings.catch_warnings():
        if resume_from is not None:  # the data module restores the data position exactly
            warnings.filterwarnings("ignore", message=re.escape(NOT_RESUMABLE_WARNING))
        # Our own checkpoints also hold numpy / python RNG states: not loadable as weights only.
        trainer.fit(
            module,
            datamodule=dm,
            ckpt_path=None if resume_from is None else str(resume_from),
            weights_only=False,
        )
    fit_s = time.perf_counter() - t1
    finished = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
    if finished and interrupt.saved_step != trainer.global_step:
        # Lightning writes last.ckpt at the end only if no periodic save wrote it before, so
        # a run whose step count is not a multiple of checkpoint_every (a max_minutes count)
        # would leave it at the last multiple: a resume would train those steps again. The
        # step of the last save keeps a run that did save at its end from a second write
        trainer.save_checkpoint(str(last), weights_only=False)
    val = {}
    if cfg.final_validation and dm.val_dataloader():
        res = trainer.validate(module, datamodule=dm, verbose=False)
        val = {k: float(v) for k, v in (res[0] if res else {}).items()}
    from train.strategies import gathered, param_share

    summary = {
        "steps": trainer.global_step,
        "setup_s": round(setup_s, 2),
        "fit_s": round(fit_s, 2),
        "trainable_params": sum(p.numel() for p in module.heads.parameters() if p.requires_grad),
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "strategy": type(trainer.strategy).__name__,
        "cluster": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        # zero3_sharded: built under zero.Init, never whole in one process; full: every rank
        # loaded the whole base (partitioned afterwards under ZeRO-3)
        "base_load": getattr(
            module, "base_load", "full" if module.base_model is not None else "offline"
        ),
        "validation": val,
    }
    if tau is not None:
        summary["val_tau"] = tau.summary()
    if budget is not None:
        summary["time_budget"] = budget.summary()
    if module.base_model is not None:
        summary["base_params_on_rank0"] = param_share(module.base_model)

    # ZeRO-3 partitions the heads too: gather them whole (on every rank, a collective), and
    # rank 0 writes the consolidated heads.safetensors.
    with gathered(module.heads.parameters()):
        if trainer.is_global_zero:
            _export(out, module, meta, summary, cfg, trainer.global_step, val)
    return summary


def _export(out: Path, module: HeadsModule, meta: dict, summary: dict, cfg, steps: int, val):
    """Write <out>/heads (weights + config with the training figures) and train_summary.json."""
    training = {
        "steps": steps,
        "prepared": str(Path(cfg.data.prepared).resolve()),
        "validation": val,
    }
    save_heads(out / "heads", module.heads, {**meta, "training": training})
    write_json(out / "train_summary.json", summary)
