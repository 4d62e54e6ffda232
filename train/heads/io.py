"""Head sets <-> heads checkpoint dirs (the format itself is train.core.checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from train.core.checkpoint import (
    FORMAT,
    HeadsMismatchError,
    check_base,
    read_meta,
    read_weights,
    write_checkpoint,
)
from train.core.config import group_defaults, validate
from train.heads.config import HeadConfig
from train.heads.headset import HeadSet


def heads_meta(heads: HeadSet, base_fingerprint: dict, base_cfg: dict, **extra: Any) -> dict:
    """Everything needed to rebuild `heads` and to check the base it belongs to."""
    return {
        "format": FORMAT,
        "arch": heads.arch,
        "head": heads.cfg.to_dict(),
        "num_heads": heads.num_heads,
        "num_layers": heads.cfg.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "draft_vocab_size": heads.draft.size if heads.draft is not None else None,
        "hidden_state_offset": heads.cfg.hidden_state_offset,
        "base_shape": heads.base_shape,
        "base": {**base_fingerprint, "config": base_cfg},
        "default_tree": None,
        **extra,
    }


# What a checkpoint from before a key existed was trained with (not today's defaults).
LEGACY = {"tie_blocks": False, "init": "ours"}
# Hydra++ checkpoints whose extra layer had no final RMSNorm (hydra-heads before the official
# prefix-mlp layer) hold these names; no weights of today's layer compute what they did.
OLD_HYDRA_PP = "prefix.attn_norm.weight"


def save_heads(directory: str | Path, heads: HeadSet, meta: dict) -> Path:
    """Write `heads` and `meta` as a heads checkpoint dir, atomically (tied tensors once)."""
    return write_checkpoint(directory, heads.unique_state(), meta)


def recorded_head(recorded: dict[str, Any]) -> HeadConfig:
    """The head config of a checkpoint: keys its hydra-heads version did not have yet take
    the value it trained with (LEGACY), then conf/head/<name>.yaml's."""
    name = recorded.get("name")
    defaults = group_defaults("head", name) if name in ("medusa", "hydra", "hydra_pp") else {}
    loss = {**defaults.get("loss", {}), **recorded.get("loss", {})}
    data = {**defaults, **LEGACY, **recorded, "loss": loss}
    return validate(HeadConfig, data, prefix="head")


def build_from(
    cfg: HeadConfig, meta_shape: dict, hidden_size: int, vocab_size: int, state: dict
) -> HeadSet:
    """Heads of `cfg` holding exactly the weights `state` (names as in our checkpoints)."""
    from train.heads import build_heads

    if cfg.name == "hydra_pp" and OLD_HYDRA_PP in state:
        raise HeadsMismatchError(
            "these Hydra++ heads were trained by a hydra-heads version whose extra layer had no "
            "final RMSNorm; today's Hydra++ is zankner/Hydra's prefix-mlp layer, which ends in "
            "one, so these weights cannot compute what they were trained to. Retrain them "
            "(hydra-heads train head=hydra_pp ...), or evaluate them with hydra-heads at "
            "commit 4254dce or earlier"
        )
    shape = {**meta_shape, "hidden_size": hidden_size, "vocab_size": vocab_size}
    placeholder = torch.empty(vocab_size, hidden_size)
    heads = build_heads(cfg, shape, placeholder, state.get("draft.to_full"))
    heads.load_unique_state(state)
    return heads


def load_heads(
    directory: str | Path, fingerprint: dict | None = None, device: str | torch.device = "cpu"
) -> tuple[HeadSet, dict]:
    """Rebuild a head set from a checkpoint dir; check it against the base's fingerprint."""
    meta = read_meta(directory)
    if fingerprint is not None:
        check_base(meta, fingerprint, str(directory))
    heads = build_from(
        recorded_head(meta["head"]),
        meta["base_shape"],
        meta["hidden_size"],
        meta["vocab_size"],
        read_weights(directory, device),
    )
    return heads.to(device).eval(), meta
