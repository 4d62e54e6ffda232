"""τ measured while training: after each validation, a few held-out prompts are decoded
greedily by the decoding engine (train/decoding/), in one batch, with the heads as they are, and
`val/tau_<tree>` is logged next to the teacher-forced estimate `val/tau_est`. The heads with
the best τ on the first tree are kept in `<out>/heads_best` (`<out>/heads` holds the last)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from train.config import ValTauConfig
from train.core.base import FrozenBase
from train.core.prompts import held_out_prompts
from train.decoding.decoder import Decoder
from train.decoding.generation import acceptance_figures
from train.decoding.sampling import eos_ids
from train.decoding.tree import Tree, preset_paths
from train.heads import save_heads

log = logging.getLogger(__name__)


def tree_named(name: str, depth: int, limit: int | None = None) -> Tree:
    """`chain` (`depth` top-1 guesses) or a preset tree of train/decoding/tree.py, cut to the
    depth `limit` the heads can propose (None: any, a recurrent head set)."""
    paths = [p for p in preset_paths(name, depth) if limit is None or len(p) <= limit]
    return Tree.from_paths(paths, limit)


class MeasuredTau(pl.Callback):
    """Decodes `prompts` (token ids) on global rank 0 after every validation that ran at a new
    step, logs `val/tau_<tree>` (and `val/tau`, the first tree's) on every rank, and saves the
    heads whose `val/tau` is the best so far to `best_dir`. Its best figure is part of the
    Lightning checkpoint, so a resumed run keeps comparing against it."""

    def __init__(
        self,
        cfg: ValTauConfig,
        base: FrozenBase,
        prompts: list[list[int]],
        best_dir: Path,
        meta: dict,
        hidden_state_offset: int = 0,
    ):
        self.cfg, self.base, self.prompts = cfg, base, prompts
        self.best_dir, self.meta, self.offset = best_dir, meta, hidden_state_offset
        self.eos = eos_ids(base.tokenizer, base.model)
        self.best: dict | None = None  # {"tau", "step"} of the heads in best_dir
        self.last: dict | None = None  # {"step", "taus", "seconds"} of the latest measurement
        self.seconds = 0.0  # decoding time, all measurements

    @torch.no_grad()
    def measure(self, heads) -> dict[str, float]:
        """τ per tree of cfg.trees for `heads`, decoding every prompt greedily."""
        was_training = heads.training
        decoder = Decoder(self.base.model, self.eos, heads, hidden_state_offset=self.offset)
        taus = {}
        try:
            for name in self.cfg.trees:
                decoder.set_tree(tree_named(name, heads.draft_depth, heads.depth_limit))
                gens = decoder.speculative(self.prompts, self.cfg.max_new_tokens)
                accepted = [a for g in gens for a in g.accepted]
                taus[name] = acceptance_figures(accepted, 0)["tau"]  # eval.json's τ
        finally:
            heads.train(was_training)
        return taus

    def on_validation_epoch_end(self, trainer: pl.Trainer, module) -> None:
        if trainer.sanity_checking or not self.prompts:
            return
        step = trainer.global_step
        if self.last is None or self.last["step"] != step:  # final_validation repeats a step
            t0 = time.perf_counter()
            taus = self.measure(module.heads) if trainer.is_global_zero else None
            taus = trainer.strategy.broadcast(taus, src=0)
            seconds = time.perf_counter() - t0
            self.seconds += seconds
            self.last = {"step": step, "taus": taus, "seconds": round(seconds, 2)}
            tau = taus[self.cfg.trees[0]]
            if self.best is None or tau > self.best["tau"]:
                self.best = {"tau": tau, "step": step}
                if trainer.is_global_zero:
                    self._save_best(module, tau, step)
        taus = self.last["taus"]
        module.log("val/tau", taus[self.cfg.trees[0]], prog_bar=True, sync_dist=False)
        for name, tau in taus.items():
            module.log(f"val/tau_{name}", tau, sync_dist=False)

    def _save_best(self, module, tau: float, step: int) -> None:
        training = {
            **(self.meta.get("training") or {}),
            "steps": step,
            "val_tau": {"tree": self.cfg.trees[0], "tau": tau},
        }
        save_heads(self.best_dir, module.heads, {**self.meta, "training": training})

    def summary(self) -> dict:
        """train_summary.json's `val_tau`: the last and the best measurement, and the cost."""
        return {
            "trees": list(self.cfg.trees),
            "prompts": len(self.prompts),
            "max_new_tokens": self.cfg.max_new_tokens,
            "last": self.last,
            "best": None if self.best is None else {**self.best, "dir": str(self.best_dir)},
            "seconds": round(self.seconds, 2),
        }

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict) -> None:
        """The best so far: the checkpoint's, or the heads in best_dir if they measured better
        (a checkpoint is written before the validation of its own step)."""
        self.best = state_dict.get("best")
        saved = self.best_dir / "heads_config.json"
        if saved.is_file():
            training = json.loads(saved.read_text()).get("training") or {}
            tau = (training.get("val_tau") or {}).get("tau")
            if tau is not None and (self.best is None or tau > self.best["tau"]):
                self.best = {"tau": tau, "step": training.get("steps")}


def measured_tau(
    cfg: ValTauConfig,
    base: FrozenBase,
    validation,
    out: Path,
    meta: dict,
    hidden_state_offset: int,
    sharded: bool,
) -> MeasuredTau | None:
    """The callback for a run, or None (and why, in the log) when it cannot or need not run:
    val_tau.prompts=0, no held-out rows, or a base sharded across ranks (ZeRO-3)."""
    if cfg.prompts == 0:
        return None
    if sharded:
        log.warning("val_tau: off under ZeRO-3 (the base is sharded, rank 0 cannot decode alone)")
        return None
    items, _ = (
        held_out_prompts(validation, cfg.prompts, cfg.max_prompt_tokens)
        if validation is not None
        else ([], 0)
    )
    if not items:
        log.warning("val_tau: no held-out prompts (prep with data.val_fraction > 0): off")
        return None
    prompts = [item.tokens for item in items]
    return MeasuredTau(cfg, base, prompts, out / "heads_best", meta, hidden_state_offset)
