"""format=hf: a Hugging Face style heads directory that is our heads checkpoint as it is.

A self-describing directory: `config.json` (`architectures`, `model_type`,
`base_model_name_or_path`, and our whole `heads_config.json`), `model.safetensors` (our own
parameter names), a `README.md` model card (with the figures of an `eval.json` when one is given
or found), and `heads_config.json` + `heads.safetensors` (the same bytes, hard-linked), so that
`hydra-heads eval heads=DIR` loads the directory as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from train.core.checkpoint import (
    CONFIG_FILE,
    FORMAT,
    FORMAT_NAME,
    HEADS_FILE,
    check_keys,
    migrate,
)
from train.core.errors import NotFound
from train.export.common import FormatError, Parsed, SameAs, load_state, read_json
from train.export.model_card import model_card
from train.heads import HEADS, HeadSet
from train.heads.io import recorded_head

HF_KEYS = ("architectures", "model_type", "base_model_name_or_path", "torch_dtype")
# `architectures` names the head set's class (MedusaHeads, HydraPPHeads, Eagle3Heads, ...)
ARCH_CLASS = {name: cls.__name__ for name, cls in HEADS.items()}


def files(
    heads_dir: Path, heads: HeadSet, meta: dict, base_id: str, res: dict | None
) -> dict[str, Any]:
    """The hf export of `heads` (from `heads_dir`, with `meta`, eval `res`): name -> content."""
    dtype = str(heads.lm_heads[0].weight.dtype).removeprefix("torch.")
    config = {
        "architectures": [ARCH_CLASS[heads.arch]],
        "model_type": "hydra_heads",
        "base_model_name_or_path": base_id,
        "torch_dtype": dtype,
        **meta,
    }
    return {
        "model.safetensors": heads_dir / HEADS_FILE,
        HEADS_FILE: SameAs("model.safetensors"),
        "config.json": json.dumps(config, indent=2, default=str) + "\n",
        CONFIG_FILE: json.dumps(meta, indent=2, default=str) + "\n",
        "README.md": model_card(heads, meta, base_id, res),
    }


def read(src: Path) -> Parsed:
    """The hf export in directory `src`, in our terms, with the base and meta it records."""
    where = src / "config.json"
    config = read_json(where)
    meta = {k: v for k, v in config.items() if k not in HF_KEYS}
    fmt = meta.get("format")
    if not (isinstance(fmt, str) and fmt.startswith(f"{FORMAT_NAME}/")):
        raise FormatError(
            f"{src / 'config.json'} is not a hydra-heads hf export (format = "
            f"{meta.get('format')!r}, expected {FORMAT!r}); zankner/Hydra heads are "
            "format=hydra, Medusa heads (vLLM, FasterDecoding) format=medusa"
        )
    meta = migrate(meta, where)  # an export of an older format, brought up to date
    check_keys(meta, where)
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise NotFound(f"{weights} not found")
    return Parsed(
        head=recorded_head(meta["head"], where),
        hidden_size=int(meta["hidden_size"]),
        vocab_size=int(meta["vocab_size"]),
        state=load_state(weights),
        base_id=str(config.get("base_model_name_or_path") or (meta.get("base") or {}).get("name")),
        base_shape=meta.get("base_shape"),
        recorded_base=(meta.get("base") or {}).get("config"),
        extra={k: v for k, v in meta.items() if k not in ("imported",)},
    )
