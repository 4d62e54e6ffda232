"""The head registry: architecture name -> class, and building a head set for a base's shape.

A new architecture costs one file, one entry here and one conf/head/*.yaml
(docs/architecture.md)."""

from __future__ import annotations

import torch

from train.core.errors import ConfigError
from train.heads.config import HeadConfig
from train.heads.eagle3 import Eagle3Heads
from train.heads.headset import HeadSet
from train.heads.hydra import HydraHeads
from train.heads.hydra_cross_attn import CrossAttnHeads
from train.heads.hydra_eagle import EagleAttnHeads
from train.heads.hydra_pp import HydraPPHeads
from train.heads.medusa import MedusaHeads

HEADS: dict[str, type[HeadSet]] = {
    "medusa": MedusaHeads,
    "hydra": HydraHeads,
    "hydra_pp": HydraPPHeads,
    "hydra_eagle": EagleAttnHeads,
    "hydra_cross_attn": CrossAttnHeads,
    "eagle3": Eagle3Heads,
}

# Base-config fields that shape the heads (Hydra++'s extra layer copies the attention shape).
BASE_SHAPE_KEYS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "num_hidden_layers",
    "max_position_embeddings",
    "initializer_range",
    "rope_parameters",
)


def base_shape(config) -> dict:
    """The fields of a transformers config that head construction reads."""
    out = {k: getattr(config, k, None) for k in BASE_SHAPE_KEYS}
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if out["rope_theta"] is None and isinstance(rp, dict):
        out["rope_theta"] = rp.get("rope_theta")
    out["rope_parameters"] = dict(rp) if isinstance(rp, dict) else None
    return {k: v for k, v in out.items() if v is not None}


def build_heads(
    cfg: HeadConfig,
    shape: dict,
    lm_head_weight: torch.Tensor,
    draft_ids: torch.Tensor | None = None,
) -> HeadSet:
    """Instantiate the head set named by `cfg.name` for a base of the given shape."""
    cls = HEADS[cfg.name]
    n_layers = int(shape.get("num_hidden_layers") or 0)
    if n_layers and cfg.hidden_state_offset >= n_layers:
        raise ConfigError(
            f"head.hidden_state_offset={cfg.hidden_state_offset} reaches past this base's "
            f"{n_layers} layers: give 0 (the final hidden state) to {n_layers - 1}"
        )
    return cls(
        cfg, int(shape["hidden_size"]), int(shape["vocab_size"]), lm_head_weight, draft_ids, shape
    )
