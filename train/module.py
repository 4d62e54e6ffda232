"""LightningModule: frozen base forward (no grad) -> heads -> CE + KL losses -> AdamW on heads."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn

from train.config import OptimConfig
from train.core.errors import ConfigError
from train.decoding.backend import head_features, wants_layers
from train.heads import HeadSet, LossConfig
from train.losses import METRIC_NAMES, HeadInput, fused_heads_loss


def lr_factor(step: int, warmup: int, total: int, final: float) -> float:
    """Linear warmup to 1, then cosine down to `final` at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


def tau_estimate(top1_rates: list[float]) -> float:
    """Acceptance length if head k's top-1 matched the base with rate a_k: 1 + sum prod a_j."""
    tau, run = 1.0, 1.0
    for a in top1_rates:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def chunked_argmax(h: torch.Tensor, weight: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """argmax_v (h @ weight.T) for (..., H) without holding all logits: (...,) token ids."""
    flat = h.reshape(-1, h.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=h.device)
    for a in range(0, flat.shape[0], chunk):
        out[a : a + chunk] = (flat[a : a + chunk] @ weight.T.to(flat.dtype)).argmax(-1)
    return out.view(h.shape[:-1])


# Head keys a resumed run may change: memory, and the initialisation the checkpoint replaces.
RESUMABLE_HEAD_KEYS = {"head.loss.chunk_size", "head.init"}


def head_changes(saved: dict, now: dict, prefix: str = "head") -> list[str]:
    """The head config keys whose values differ between a checkpoint and this run (keys only
    one of them records, as an older checkpoint format lacks newer ones, are not compared)."""
    out = []
    for k in sorted(set(saved) & set(now)):
        a, b, name = saved[k], now[k], f"{prefix}.{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += head_changes(a, b, name)
        elif a != b and name not in RESUMABLE_HEAD_KEYS:
            out.append(f"{name}: {a!r} in the checkpoint, {b!r} now")
    return out


class HeadsModule(pl.LightningModule):
    """Trains a head set against a frozen base model (online) or cached hidden states (offline).

    Only head parameters reach the optimizer; the base stays in eval mode with no gradients,
    and its weights never enter a Lightning checkpoint (they are re-attached on load).
    """

    def __init__(
        self,
        heads: HeadSet,
        optim: OptimConfig,
        loss: LossConfig,
        max_steps: int,
        base_model: nn.Module | None = None,
        teacher_weight: torch.Tensor | None = None,
        embed_weight: torch.Tensor | None = None,
        hidden_state_offset: int = 0,
        meta: dict | None = None,
        base_loader: Callable[[dict | None], nn.Module] | None = None,
        teacher_softcap: float | None = None,
    ):
        super().__init__()
        self.heads = heads
        self.optim_cfg = optim
        self.loss_cfg = loss
        self.max_steps = max_steps
        self.offset = hidden_state_offset
        self.meta = meta or {}
        self.teacher_softcap = teacher_softcap  # the base's final_logit_softcapping (Gemma-2)
        self.base_model = base_model
        # Loads the base inside configure_model (ZeRO-3: partitioned as it is built).
        self._base_loader = base_loader
        if base_model is None and base_loader is None:
            if teacher_weight is None or embed_weight is None:
                raise ValueError("offline training needs the base lm_head and embedding weights")
            self.register_buffer("_teacher_w", teacher_weight.detach().clone(), persistent=False)
            self.register_buffer("_embed_w", embed_weight.detach().clone(), persistent=False)
        self._val: dict[str, torch.Tensor] = {}

    # -- frozen base pieces ---------------------------------------------------------------
    @property
    def teacher_weight(self) -> torch.Tensor:
        if self.base_model is not None:
            return self.base_model.get_output_embeddings().weight
        return self._teacher_w

    @property
    def embed_weight(self) -> torch.Tensor:
        if self.base_model is not None:
            return self.base_model.get_input_embeddings().weight
        return self._embed_w

    # -- DeepSpeed ZeRO-3 ---------------------------------------------------------------------
    def _zero3(self) -> bool:
        t = self._trainer
        return t is not None and bool(getattr(t.strategy, "zero_stage_3", False))

    def configure_model(self) -> None:
        """Lightning runs this under the strategy's sharding context (`zero.Init` for ZeRO-3),
        once the process group exists: the deferred base is loaded here, straight into shards."""
        if self.base_model is not None or self._base_loader is None:
            return
        ds_config = self.trainer.strategy.config if self._zero3() else None
        self.base_model = self._base_loader(ds_config)
        self.base_load = "zero3_sharded" if ds_config is not None else "deferred"

    def setup(self, stage: str) -> None:
        if self._zero3():
            # ZeRO-3 checkpoints leave the frozen base out (exclude_frozen_parameters); it is
            # re-attached from the loaded base, not from the checkpoint.
            self.strict_loading = False

    def _register_external_params(self) -> None:
        """ZeRO-3 gathers a parameter only inside its own module's forward. The loss reads the
        heads' output projections, the teacher lm_head and the embedding table as raw tensors,
        so they are registered with the module whose forward runs the whole step."""
        if not self._zero3():
            return
        import deepspeed

        top = self.trainer.strategy.model
        top = getattr(top, "module", top)
        params = [lm.weight for lm in self.heads.lm_heads]
        params += [lm.bias for lm in self.heads.lm_heads if lm.bias is not None]
        if self.base_model is not None:
            params += [self.teacher_weight, self.embed_weight]
        for p in {id(p): p for p in params}.values():
            deepspeed.zero.register_external_parameter(top, p)

    def on_fit_start(self) -> None:
        self._register_external_params()

    def on_validation_start(self) -> None:
        self._register_external_params()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.base_model is not None:
            self.base_model.eval()  # the teacher never runs dropout
        return self

    # -- the computation ------------------------------------------------------------------
    # Over 80 lines: the online and offline paths share every step after the hidden states;
    # one function keeps that order in one place.
    def compute(self, batch: dict) -> tuple[torch.Tensor, list[dict]]:
        """Total loss and per-head figures for one batch."""
        ids, lmask, seg = batch["input_ids"], batch["loss_mask"], batch["segment_ids"]
        T = ids.shape[1]
        dtype = self.heads.lm_heads[0].weight.dtype
        with torch.no_grad():
            if "hidden" in batch:  # offline: the cached states (EAGLE-3's: its fused layers)
                final = batch["hidden"]
                ctx_in = batch["aux_hidden"] if isinstance(self.heads.features, tuple) else final
            else:
                features = self.heads.features  # the offset's layer, or EAGLE-3's fused ones
                out = self.base_model.model(
                    input_ids=ids,
                    attention_mask=batch["attention_mask"],
                    output_hidden_states=wants_layers(features),
                    use_cache=False,
                )
                final = out.last_hidden_state  # (B, T, H), post final norm
                ctx_in = head_features(out, features)
            embeds = F.embedding(ids, self.embed_weight) if self.heads.uses_path else None
        lengths = batch["attention_mask"].sum(-1)  # unpadded: the noise scale (zankner/Hydra)
        embeds = None if embeds is None else embeds.to(dtype)
        # Head k scores position t when x_{t+k+1} is an assistant token of t's own segment;
        # the heads run at those positions only: (N_k,) batch and time indices per head.
        empty = ids.new_zeros(0)
        select = []
        for k in range(1, self.heads.num_heads + 1):
            L = T - k - 1
            if L <= 0:
                select.append((empty, empty))
                continue
            valid = lmask[:, k + 1 :] & (seg[:, :L] == seg[:, k + 1 :])
            select.append(valid.nonzero(as_tuple=True))
        states = self.heads(ctx_in.to(dtype), embeds, lengths, select)  # K x (N_k, H)
        lc = self.loss_cfg
        draft = self.heads.draft
        tw = self.teacher_weight if draft is None else self.teacher_weight[draft.to_full]
        B = ids.shape[0]
        # Teacher rows: every position p whose next token x_{p+1} some head is scored on (head k
        # at t = p - k). Their logits, softmax and argmax are computed once in the loss, shared
        # by all heads.
        need = torch.zeros_like(lmask)
        need[:, 1 : T - 1] = lmask[:, 2:]
        tb, tp = need.nonzero(as_tuple=True)
        row_of = torch.full((B, T), -1, dtype=torch.long, device=ids.device)
        row_of[tb, tp] = torch.arange(tb.numel(), device=ids.device)
        # The base's argmax for the "vs base" accuracies: over the full vocab in validation
        # (then mapped into the draft vocab); in training over the head's draft vocab, from the
        # shared teacher logits.
        teacher_top1 = None
        if draft is not None and not self.training:
            teacher_top1 = draft.draft_ids(chunked_argmax(final[tb, tp], self.teacher_weight))
        weights = lc.head_weights(self.heads.num_heads)
        # Keeps every head parameter in the graph even if a batch has no valid position (DDP).
        # Not under ZeRO-3: its parameters are empty shards outside their modules' forward,
        # and its own gradient reduction copes with parameters a step did not use.
        if self._zero3():
            total = states[0].sum() * 0.0
        else:
            total = sum(p.sum() for p in self.heads.parameters() if p.requires_grad) * 0.0
        inputs, ks = [], []
        for k in range(1, self.heads.num_heads + 1):
            b, t = select[k - 1]
            if b.numel() == 0:
                continue
            target = ids[b, t + k + 1]
            if draft is not None:
                target = draft.draft_ids(target)
            lm = self.heads.lm_heads[k - 1]
            inputs.append(
                HeadInput(
                    states[k - 1],
                    lm.weight,
                    lm.bias,
                    row_of[b, t + k],
                    target,
                    weights[k - 1],
                )
            )
            ks.append(k)
        per_head = []
        if inputs:
            loss, losses = fused_heads_loss(
                inputs,
                final[tb, tp].to(dtype),
                tw,
                teacher_top1,
                lm_weight=lc.lm_weight,
                distill_weight=lc.distill_weight,
                temperature=lc.temperature,
                chunk_size=lc.chunk_size,
                kinds=lc.distill_kinds(),
                teacher_softcap=self.teacher_softcap,
            )
            total = total + loss
            for k, hl in zip(ks, losses, strict=True):
                per_head.append(
                    {
                        "k": k,
                        "loss": hl.loss,
                        "ce": hl.ce,
                        "distill": hl.distill,
                        "counts": hl.counts,
                        "n": hl.n,
                    }
                )
        return total, per_head

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, per_head = self.compute(batch)
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        for h in per_head:
            k, n = h["k"], max(h["n"], 1)
            self.log(f"train/loss_h{k}", h["loss"], batch_size=bs)
            for name, c in zip(METRIC_NAMES, h["counts"], strict=True):
                self.log(
                    f"train/{name}_h{k}",
                    c.float() / n,
                    batch_size=bs,
                    prog_bar=(k == 1 and name == "top1"),
                )
        return loss

    def on_validation_epoch_start(self) -> None:
        K = self.heads.num_heads
        self._val = {
            "counts": torch.zeros(K, 4, dtype=torch.long, device=self.device),
            "n": torch.zeros(K, dtype=torch.long, device=self.device),
            "loss": torch.zeros((), device=self.device),
            "batches": torch.zeros((), device=self.device),
        }

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, per_head = self.compute(batch)
        self._val["loss"] += loss.detach()
        self._val["batches"] += 1
        for h in per_head:
            self._val["counts"][h["k"] - 1] += h["counts"]
            self._val["n"][h["k"] - 1] += h["n"]

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        reduce = self.trainer.strategy.reduce
        counts = reduce(self._val["counts"].float(), reduce_op="sum")
        n = reduce(self._val["n"].float(), reduce_op="sum").clamp_min(1)
        loss = reduce(self._val["loss"], reduce_op="sum") / reduce(
            self._val["batches"], reduce_op="sum"
        ).clamp_min(1)
        rates = counts / n[:, None]
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        for k in range(rates.shape[0]):
            for j, name in enumerate(METRIC_NAMES):
                self.log(f"val/{name}_h{k + 1}", rates[k, j])
        self.log("val/tau_est", tau_estimate(rates[:, 2].tolist()), prog_bar=True)
        self.val_rates = rates.cpu()

    # -- optimisation ---------------------------------------------------------------------
    def configure_optimizers(self):
        c = self.optim_cfg
        decay = [p for p in self.heads.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.heads.parameters() if p.requires_grad and p.ndim < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": c.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=c.lr,
            betas=tuple(c.betas),
            eps=c.eps,
            fused=self._fused_adamw() or None,
        )
        if opt.defaults.get("fused"):
            # The fused step takes no loss-scaler arguments from us, so it tells torch's
            # GradScaler and Lightning's precision plugin that it unscales nothing itself:
            # they unscale before it (as for any optimizer), and Lightning's gradient clipping
            # (trainer.gradient_clip_val), which refuses optimizers that unscale internally,
            # runs under bf16-mixed and 16-mixed too.
            opt._step_supports_amp_scaling = False
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, c.warmup_steps, self.max_steps, c.final_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _fused_adamw(self) -> bool:
        """torch's fused AdamW: one kernel over all head parameters instead of a handful of
        ops per tensor (31.7M demo-head parameters: 21 ms a step on 2 CPU cores, against 122
        ms for the per-tensor loop; an offline step is ~0.8 s). Not under DeepSpeed, which
        steps its own optimizer wrapper, nor for parameters the fused kernel does not take
        (not float, or not on a CPU or CUDA device)."""
        trainer = self._trainer
        if trainer is not None and isinstance(trainer.strategy, DeepSpeedStrategy):
            return False
        return all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda")
            for p in self.heads.parameters()
            if p.requires_grad
        )

    # -- checkpoints: heads + optimizer + schedule + RNG, never the base ---------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        sd = checkpoint["state_dict"]
        for key in [k for k in sd if k.startswith("base_model.")]:
            del sd[key]
        checkpoint["hydra_heads"] = self.meta
        checkpoint["rng"] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from train.core.checkpoint import check_base

        saved = checkpoint.get("hydra_heads") or {}
        if saved and self.meta:
            check_base(saved, self.meta["base"], "in the checkpoint")
            changed = head_changes(saved.get("head") or {}, self.meta.get("head") or {})
            if changed:
                raise ConfigError(
                    "the checkpoint was trained with another head config ("
                    + "; ".join(changed)
                    + "): resume with the checkpoint's head settings, or train into a new out= "
                    "(resume=false there)"
                )
        # DeepSpeed's engine restores the module weights itself: its client state has none.
        sd = checkpoint.get("state_dict")
        if self.base_model is not None and sd is not None:
            for k, v in self.base_model.state_dict(prefix="base_model.").items():
                sd.setdefault(k, v)
        # Applied just before the next training batch: restoring it here would let whatever
        # runs in between (dataloader start-up, for one) shift the random streams.
        self._pending_rng = checkpoint.get("rng")

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        rng = getattr(self, "_pending_rng", None)
        if rng:
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
            self._pending_rng = None
