"""Head sets <-> heads checkpoint dirs (the format itself is train.core.checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from train.core.checkpoint import FORMAT, check_base, read_meta, read_weights, write_checkpoint
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


def save_heads(directory: str | Path, heads: HeadSet, meta: dict) -> Path:
    """Write `heads` and `meta` as a heads checkpoint dir, atomically."""
    return write_checkpoint(directory, heads.state_dict(), meta)


def recorded_head(recorded: dict[str, Any]) -> HeadConfig:
    """The head config of a checkpoint, completed with conf/head/<name>.yaml for keys that its
    hydra-heads version did not have yet."""
    name = recorded.get("name")
    defaults = group_defaults("head", name) if name in ("medusa", "hydra", "hydra_pp") else {}
    loss = {**defaults.get("loss", {}), **recorded.get("loss", {})}
    return validate(HeadConfig, {**defaults, **recorded, "loss": loss}, prefix="head")


def build_from(
    cfg: HeadConfig, meta_shape: dict, hidden_size: int, vocab_size: int, state: dict
) -> HeadSet:
    """Heads of `cfg` holding exactly the weights `state` (names as in our checkpoints)."""
    from train.heads import build_heads

    shape = {**meta_shape, "hidden_size": hidden_size, "vocab_size": vocab_size}
    placeholder = torch.empty(vocab_size, hidden_size)
    heads = build_heads(cfg, shape, placeholder, state.get("draft.to_full"))
    heads.load_state_dict(state, strict=True)
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
