"""The heads checkpoint format: a dir of `heads.safetensors` (weights only, never pickle) and
`heads_config.json` (architecture, sizes, base fingerprint, training figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from train.core.atomic import staged_dir, write_json
from train.core.errors import NotFound, UserError

HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "heads_config.json"
FORMAT = "hydra-heads/1"


class HeadsMismatchError(UserError, ValueError):
    """Heads trained for one base model are being loaded onto a base of another shape."""


def write_checkpoint(directory: str | Path, state: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write a heads state dict and its meta into `directory`, atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with staged_dir(directory) as tmp:
        save_file(tensors, str(tmp / HEADS_FILE), metadata={"format": "pt", "hydra_heads": FORMAT})
        write_json(tmp / CONFIG_FILE, meta)
    return Path(directory)


def read_meta(directory: str | Path) -> dict[str, Any]:
    """heads_config.json of a checkpoint dir, checked to be ours and complete."""
    d = Path(directory)
    cfg = d / CONFIG_FILE
    if not (d / HEADS_FILE).is_file() or not cfg.is_file():
        raise NotFound(
            f"{d} is not a heads checkpoint: it needs {HEADS_FILE} and {CONFIG_FILE} "
            "(written by `hydra-heads train` under <out>/heads)"
        )
    meta = json.loads(cfg.read_text())
    if meta.get("format") != FORMAT:
        raise HeadsMismatchError(f"{cfg} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def read_weights(directory: str | Path, device: str | torch.device = "cpu") -> dict:
    """heads.safetensors of a checkpoint dir."""
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / HEADS_FILE), device=str(device))


def check_base(meta: dict, fingerprint: dict, where: str = "") -> None:
    """Fail clearly when the heads were trained on a base of another hidden size or vocab."""
    want = (meta["hidden_size"], meta["vocab_size"])
    have = (fingerprint["hidden_size"], fingerprint["vocab_size"])
    if want != have:
        trained = meta.get("base", {}).get("name")
        raise HeadsMismatchError(
            f"heads {where} were trained for a base with hidden_size={want[0]}, "
            f"vocab_size={want[1]} ({trained}), but this base model ({fingerprint.get('name')}) "
            f"has hidden_size={have[0]}, vocab_size={have[1]}; use base={trained} or heads "
            "trained for this base"
        )
