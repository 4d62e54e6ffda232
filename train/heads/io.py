"""Head sets <-> heads checkpoint dirs (the format itself is train.core.checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from train.core.base import BaseConfig
from train.core.checkpoint import (
    CONFIG_FILE,
    FORMAT,
    HEADS_FILE,
    CheckpointError,
    HeadsMismatchError,
    check_base,
    read_meta,
    read_weights,
    write_checkpoint,
)
from train.core.config import validate
from train.core.errors import ConfigError
from train.heads.blocks import DraftVocabError
from train.heads.config import HeadConfig
from train.heads.headset import HeadSet
from train.heads.registry import build_heads


def heads_meta(
    heads: HeadSet, base_fingerprint: dict, base_cfg: BaseConfig | dict, **extra: Any
) -> dict:
    """Everything needed to rebuild `heads` and to check the base it belongs to, in full: the
    whole head config and the whole base config (`{}`: none recorded), so that loading them
    composes no config. A base config missing keys fails here, not when it is loaded."""
    if isinstance(base_cfg, BaseConfig):
        base_cfg = base_cfg.to_dict()
    elif base_cfg:
        base_cfg = validate(BaseConfig, base_cfg, prefix="base").to_dict()
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


# Hydra++ checkpoints whose extra layer had no final RMSNorm (hydra-heads before the official
# prefix-mlp layer) hold these names; no weights of today's layer compute what they did.
OLD_HYDRA_PP = "prefix.attn_norm.weight"


def save_heads(directory: str | Path, heads: HeadSet, meta: dict) -> Path:
    """Write `heads` and `meta` as a heads checkpoint dir, atomically (tied tensors once)."""
    return write_checkpoint(directory, heads.unique_state(), meta)


def recorded_head(recorded: dict[str, Any], where: str | Path = "heads_config.json") -> HeadConfig:
    """The head config recorded in a checkpoint's meta (current format: every key present, see
    `train.core.checkpoint.migrate` for older ones). Composes no config."""
    try:
        return validate(HeadConfig, recorded, prefix="head")
    except ConfigError as e:
        raise CheckpointError(
            f"{where} records an incomplete or invalid head config: {e}; re-export or retrain "
            "the heads (`hydra-heads train ...`), or copy the checkpoint directory again"
        ) from None


def build_from(
    cfg: HeadConfig,
    meta_shape: dict,
    hidden_size: int,
    vocab_size: int,
    state: dict,
    where: str | Path = "the heads weights",
) -> HeadSet:
    """Heads of `cfg` holding exactly the weights `state` (names as in our checkpoints, read
    from `where`)."""
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
    try:
        heads = build_heads(cfg, shape, placeholder, state.get("draft.to_full"))
    except DraftVocabError as e:  # a draft vocab map that does not fit the vocab
        raise CheckpointError(
            f"{where}: {e}; re-export or retrain the heads for this base"
        ) from None
    try:
        heads.load_unique_state(state)
    except RuntimeError as e:  # load_state_dict: missing, unexpected or misshapen tensors
        raise CheckpointError(
            f"{where} does not hold the tensors of the {cfg.name} heads its {CONFIG_FILE} "
            f"describes ({e}); the two files do not belong together: re-export or retrain "
            "the heads, or copy the checkpoint directory again"
        ) from None
    return heads


def load_heads(
    directory: str | Path, fingerprint: dict | None = None, device: str | torch.device = "cpu"
) -> tuple[HeadSet, dict]:
    """Rebuild a head set from a checkpoint dir; check it against the base's fingerprint."""
    meta = read_meta(directory)
    if fingerprint is not None:
        check_base(meta, fingerprint, str(directory))
    cfg = recorded_head(meta["head"], Path(directory) / CONFIG_FILE)
    heads = build_from(
        cfg,
        meta["base_shape"],
        meta["hidden_size"],
        meta["vocab_size"],
        read_weights(directory, device),
        Path(directory) / HEADS_FILE,
    )
    return heads.to(device).eval(), meta
