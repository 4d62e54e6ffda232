"""The heads checkpoint format: a dir of `heads.safetensors` (weights only, never pickle) and
`heads_config.json` (architecture, sizes, base fingerprint, training figures).

A checkpoint describes itself: `heads_config.json` holds every head-config key and the whole
recorded base config, so loading it composes no config from `conf/` (and imports neither
hydra-core nor omegaconf). Older formats are brought up to date by `migrate`, one explicit step
per version, whose values are constants written here (what those versions trained with), never
today's `conf/`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from train.core.atomic import staged_dir, write_json
from train.core.errors import NotFound, UserError

HEADS_FILE = "heads.safetensors"
CONFIG_FILE = "heads_config.json"
FORMAT_NAME = "hydra-heads"
VERSION = 5
FORMAT = f"{FORMAT_NAME}/{VERSION}"

# Top-level keys of heads_config.json that rebuilding the heads reads, and their JSON types.
REQUIRED = {"arch": str, "head": dict, "hidden_size": int, "vocab_size": int, "base_shape": dict}


class HeadsMismatchError(UserError, ValueError):
    """Heads trained for one base model are being loaded onto a base of another shape."""


class CheckpointError(UserError, ValueError):
    """A heads checkpoint file cannot be read: truncated, corrupt, not ours, or missing keys."""


class FormatTooNewError(CheckpointError):
    """The checkpoint was written by a newer hydra-heads, in a format this one does not know."""


# -- migrations ----------------------------------------------------------------------------------
# hydra-heads/1 (every version up to the self-describing format) recorded the head config and
# the base config as the schemas of the time had them; keys added later were filled from conf/
# at load time. These are those values, frozen: conf/head/_shared.yaml and conf/head/<name>.yaml
# (identical in every release that wrote format 1; `tie_blocks` and `init` came last, and what
# heads from before them computed is tie_blocks=false, init=ours), conf/base/_shared.yaml, and
# the tiny base's shape fields (dataclass defaults before they moved to conf/base/tiny_random).
V1_HEAD = {
    "num_heads": 4,
    "num_layers": 1,
    "hidden_state_offset": 0,
    "draft_vocab_size": None,
    "noise_alpha": 0.0,
    "dropout": 0.0,
    "bias": False,
    "tie_blocks": False,
    "init": "ours",
}
V1_LOSS = {
    "lm_weight": 1.0,
    "distill_weight": 0.0,
    "temperature": 1.0,
    "head_weighting": "constant",
    "head_decay": 0.8,
    "chunk_size": 1024,
}
V1_HEAD_BY_ARCH: dict[str, dict[str, Any]] = {
    "medusa": {"loss": {"head_weighting": "geometric"}},
    "hydra": {},
    "hydra_pp": {"num_layers": 4, "loss": {"lm_weight": 0.0, "distill_weight": 1.0}},
}
V1_BASE = {
    "path": None,
    "gguf_file": None,
    "package": None,
    "revision": None,
    "dtype": "float32",
    "trust_remote_code": False,
    "cache": True,
    "tiny": None,
    "arch": None,
}
V1_TINY = {
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "seed": 0,
    "vocab_size": None,
}


def _v1_to_v2(meta: dict[str, Any]) -> dict[str, Any]:
    """Format 1 -> 2: fill the head and base-config keys a format-1 file may lack."""
    head = meta.get("head")
    if isinstance(head, dict) and isinstance(head.get("loss", {}), dict):  # else: check_keys
        arch = head.get("name", meta.get("arch"))
        by_arch = V1_HEAD_BY_ARCH.get(arch, {}) if isinstance(arch, str) else {}
        loss = {**V1_LOSS, **by_arch.get("loss", {}), **head.get("loss", {})}
        defaults = {**V1_HEAD, **{k: v for k, v in by_arch.items() if k != "loss"}}
        # the top-level copies of these keys were written by every format-1 release
        for key in ("num_heads", "num_layers", "hidden_state_offset", "draft_vocab_size"):
            if key in meta:
                defaults[key] = meta[key]
        if arch is not None:
            defaults["name"] = arch
        meta["head"] = {**defaults, **head, "loss": loss}

    base = meta.get("base")
    if isinstance(base, dict) and isinstance(base.get("config"), dict) and base["config"]:
        cfg = {**V1_BASE, **base["config"]}
        if isinstance(cfg["tiny"], dict):
            cfg["tiny"] = {**V1_TINY, **cfg["tiny"]}
        base["config"] = cfg
    meta["format"] = f"{FORMAT_NAME}/2"
    return meta


# Format 3 added the distillation divergence (head.loss.kind, head.loss.mix); every earlier
# checkpoint was trained with forward KL.
V2_LOSS = {"kind": "kl", "mix": None}


def _v2_to_v3(meta: dict[str, Any]) -> dict[str, Any]:
    """Format 2 -> 3: the loss's distillation kind, forward KL for every format-2 file."""
    head = meta.get("head")
    if isinstance(head, dict) and isinstance(head.get("loss"), dict):  # else: check_keys
        head["loss"] = {**V2_LOSS, **head["loss"]}
    meta["format"] = f"{FORMAT_NAME}/3"
    return meta


def _fill_head(meta: dict[str, Any], defaults: dict[str, Any], version: int) -> dict[str, Any]:
    """Give `meta`'s head the keys of `defaults` it lacks (what every file of the format before
    `version` computed), and mark it format `version`."""
    head = meta.get("head")
    if isinstance(head, dict):  # else: check_keys
        meta["head"] = {**defaults, **head}
    meta["format"] = f"{FORMAT_NAME}/{version}"
    return meta


# Format 4 added EAGLE-3's fused layers (head.aux_layers); no earlier head fused any.
V3_HEAD = {"aux_layers": None}


def _v3_to_v4(meta: dict[str, Any]) -> dict[str, Any]:
    """Format 3 -> 4: head.aux_layers, null for every format-3 file."""
    return _fill_head(meta, V3_HEAD, 4)


# Format 5 added head.freeze_lm_heads; every earlier head trained its output projections.
V4_HEAD = {"freeze_lm_heads": False}


def _v4_to_v5(meta: dict[str, Any]) -> dict[str, Any]:
    """Format 4 -> 5: head.freeze_lm_heads, false for every format-4 file."""
    return _fill_head(meta, V4_HEAD, 5)


# MIGRATIONS[v] turns a format-v meta into a format-(v+1) one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {
    1: _v1_to_v2,
    2: _v2_to_v3,
    3: _v3_to_v4,
    4: _v4_to_v5,
}


def format_version(meta: dict[str, Any], where: str | Path = "heads_config.json") -> int:
    """The format version of a checkpoint's meta (`hydra-heads/<n>` -> n), checked to be one
    this hydra-heads reads."""
    fmt = meta.get("format")
    name, _, number = fmt.partition("/") if isinstance(fmt, str) else ("", "", "")
    if name != FORMAT_NAME or not number.isdigit():
        raise CheckpointError(
            f"{where} has format {fmt!r}: it is not a hydra-heads heads checkpoint (expected "
            f"{FORMAT!r}); write one with `hydra-heads train` or `hydra-heads import`"
        )
    version = int(number)
    if version > VERSION:
        raise FormatTooNewError(
            f"{where} has format {fmt!r}, newer than this hydra-heads reads ({FORMAT!r} and "
            "older): it was written by a newer hydra-heads; upgrade hydra-heads "
            "(`pip install -U hydra-heads`) to load it"
        )
    if version < 1:
        raise CheckpointError(f"{where} has format {fmt!r}, which no hydra-heads ever wrote")
    return version


def migrate(meta: dict[str, Any], where: str | Path = "heads_config.json") -> dict[str, Any]:
    """`meta` of any known format as the current one (a copy; `meta` itself is unchanged)."""
    version = format_version(meta, where)
    out = copy.deepcopy(meta)
    while version < VERSION:
        out = MIGRATIONS[version](out)
        version += 1
    return out


# -- reading and writing ---------------------------------------------------------------------
def write_checkpoint(directory: str | Path, state: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write a heads state dict and its meta into `directory`, atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with staged_dir(directory) as tmp:
        save_file(tensors, str(tmp / HEADS_FILE), metadata={"format": "pt", "hydra_heads": FORMAT})
        write_json(tmp / CONFIG_FILE, meta)
    return Path(directory)


_FIX = (
    "re-export or retrain the heads (`hydra-heads train ...`), or copy the checkpoint "
    "directory again if it was cut short in transfer"
)


def read_meta(directory: str | Path) -> dict[str, Any]:
    """heads_config.json of a checkpoint dir, checked to be ours and complete, migrated to the
    current format."""
    d = Path(directory)
    cfg = d / CONFIG_FILE
    if not (d / HEADS_FILE).is_file() or not cfg.is_file():
        raise NotFound(
            f"{d} is not a heads checkpoint: it needs {HEADS_FILE} and {CONFIG_FILE} "
            "(written by `hydra-heads train` under <out>/heads)"
        )
    try:
        meta = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e}): it is damaged; {_FIX}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{cfg} holds a JSON {type(meta).__name__}, not an object: it is not a heads "
            f"checkpoint config; {_FIX}"
        )
    meta = migrate(meta, cfg)
    check_keys(meta, cfg)
    return meta


def check_keys(meta: dict[str, Any], where: str | Path) -> None:
    """Fail clearly when `meta` lacks a key that rebuilding the heads reads."""
    bad = [
        k
        for k, tp in REQUIRED.items()
        if not isinstance(meta.get(k), tp) or (tp is int and isinstance(meta.get(k), bool))
    ]
    if bad:
        keys = ", ".join(f"'{k}'" for k in bad)
        raise CheckpointError(
            f"{where} lacks or has a malformed {keys} (needs {', '.join(REQUIRED)}): it is "
            f"incomplete or damaged; {_FIX}"
        )


def read_weights(directory: str | Path, device: str | torch.device = "cpu") -> dict:
    """heads.safetensors of a checkpoint dir; a truncated or corrupt file is a CheckpointError."""
    return read_safetensors(Path(directory) / HEADS_FILE, device)


def read_safetensors(path: str | Path, device: str | torch.device = "cpu") -> dict:
    """The tensors of a safetensors file; one that cannot be parsed is a CheckpointError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise NotFound(f"{path} not found")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} is truncated or corrupt ({type(e).__name__}: {e}); {_FIX}"
        ) from None


def check_base(meta: dict, fingerprint: dict, where: str = "") -> None:
    """Fail clearly when the heads were trained on a base of another hidden size or vocab."""
    want = (meta["hidden_size"], meta["vocab_size"])
    have = (fingerprint["hidden_size"], fingerprint["vocab_size"])
    if want != have:
        trained = (meta.get("base") or {}).get("name")
        raise HeadsMismatchError(
            f"heads {where} were trained for a base with hidden_size={want[0]}, "
            f"vocab_size={want[1]} ({trained}), but this base model ({fingerprint.get('name')}) "
            f"has hidden_size={have[0]}, vocab_size={have[1]}; use base={trained} or heads "
            "trained for this base"
        )
