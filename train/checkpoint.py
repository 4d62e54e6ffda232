"""Heads checkpoints: `heads.safetensors` (weights only) + `heads_config.json` (everything else)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from train.atomic import publish_dir
from train.heads import HeadConfig, HeadSet, build_heads
from train.heads.blocks import LossConfig

HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "heads_config.json"
FORMAT = "hydra-heads/1"


class HeadsMismatchError(ValueError):
    """Heads trained for one base model are being loaded onto a base of another shape."""


def heads_meta(heads: HeadSet, base_fingerprint: dict, base_cfg: dict, **extra: Any) -> dict:
    """Everything needed to rebuild `heads` and to check the base it belongs to."""
    from dataclasses import asdict

    return {
        "format": FORMAT,
        "arch": heads.arch,
        "head": asdict(heads.cfg),
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
    """Write the two files into `directory`, atomically (a temp dir renamed into place)."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.parent / f".{d.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(tmp / HEADS_FILE), metadata={"format": "pt", "hydra_heads": FORMAT})
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    publish_dir(tmp, d)
    return d


def read_meta(directory: str | Path) -> dict:
    d = Path(directory)
    cfg = d / CONFIG_FILE
    if not (d / HEADS_FILE).is_file() or not cfg.is_file():
        raise FileNotFoundError(
            f"{d} is not a heads checkpoint: it needs {HEADS_FILE} and {CONFIG_FILE} "
            "(written by `hydra-heads train` under <out>/heads)"
        )
    meta = json.loads(cfg.read_text())
    if meta.get("format") != FORMAT:
        raise HeadsMismatchError(f"{cfg} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


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


def load_heads(
    directory: str | Path, fingerprint: dict | None = None, device: str | torch.device = "cpu"
) -> tuple[HeadSet, dict]:
    """Rebuild a head set from a checkpoint dir; check it against the base's fingerprint."""
    from safetensors.torch import load_file

    d = Path(directory)
    meta = read_meta(d)
    if fingerprint is not None:
        check_base(meta, fingerprint, str(d))
    state = load_file(str(d / HEADS_FILE), device=str(device))
    head_dict = dict(meta["head"])
    head_dict["loss"] = LossConfig(**head_dict.get("loss", {}))
    cfg = HeadConfig(**head_dict)
    draft = state.get("draft.to_full")
    shape = {
        **meta["base_shape"],
        "hidden_size": meta["hidden_size"],
        "vocab_size": meta["vocab_size"],
    }
    placeholder = torch.empty(meta["vocab_size"], meta["hidden_size"])
    heads = build_heads(cfg, shape, placeholder, draft)
    heads.load_state_dict(state, strict=True)
    return heads.to(device).eval(), meta
