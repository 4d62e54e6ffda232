"""Draft head architectures and their registry: one file per architecture, one entry each."""

from __future__ import annotations

from train.heads.config import HeadConfig, LossConfig
from train.heads.headset import HeadSet
from train.heads.io import heads_meta, load_heads, save_heads
from train.heads.registry import BASE_SHAPE_KEYS, HEADS, base_shape, build_heads

__all__ = [
    "BASE_SHAPE_KEYS",
    "HEADS",
    "HeadConfig",
    "HeadSet",
    "LossConfig",
    "base_shape",
    "build_heads",
    "heads_meta",
    "load_heads",
    "save_heads",
]
