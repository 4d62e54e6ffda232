"""What the base's attention layers may see: full causal attention or a sliding window.

The decoder builds its own additive masks (a tree's ancestry, a short row's hole), and a
transformers model takes a 4-D mask as it is: it adds no sliding window of its own to one. So
a base whose layers attend over a window (Mistral, Mixtral, Phi-3 and Qwen3-MoE configs with
`sliding_window`; Qwen2/3 with `use_sliding_window`; Gemma-2/3's alternating
`layer_types`) gets the window applied here, from the positions of every query and key, with
transformers' own rule (a query at q sees a key at k when q - window < k <= q). Models with
`layer_types` take a mask per kind of layer (their forward reads a {kind: mask} dict); the
others take one mask, which every layer shares.

Without this, a verify pass over more than `window` positions attended past the window while a
plain step (transformers' own mask) did not: speculative greedy output differed from plain
greedy. Kinds of layer with another rule (Llama-4's `chunked_attention`) are refused.
"""

from __future__ import annotations

import torch

from train.core.errors import UserError

FULL, SLIDING = "full_attention", "sliding_attention"


class AttentionLayoutError(UserError, ValueError):
    """A base whose attention pattern the decoder cannot reproduce."""


class AttentionLayout:
    """The base's attention pattern, read from its config."""

    def __init__(self, config):
        kinds = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        name = type(config).__name__
        if kinds is not None:
            other = sorted(set(kinds) - {FULL, SLIDING})
            if other:
                raise AttentionLayoutError(
                    f"{name} has layers of kind {other}: speculative decoding here supports "
                    f"'{FULL}' and '{SLIDING}' layers only. Use a base without them."
                )
            self.per_kind = True
            self.sliding = SLIDING in kinds
        else:
            self.per_kind = False
            self.sliding = window is not None
        if self.sliding and (not isinstance(window, int) or window < 1):
            raise AttentionLayoutError(
                f"{name} has sliding-window layers but sliding_window={window!r}: it needs a "
                "positive number of positions"
            )
        self.window = int(window) if self.sliding else None

    def apply(self, mask: torch.Tensor | None, qpos: torch.Tensor, start: int):
        """The base's mask for a forward of n queries at positions `qpos` (B, n), written
        after `start` cached slots (slot j < start holds position j, or is a hole that `mask`
        hides), from the decoder's (B, 1, n, start + n) additive `mask`. None stays None: then
        the model builds its own masks, its window included (one query, no hole)."""
        if mask is None or not self.sliding:
            return mask
        B = qpos.shape[0]
        prefix = torch.arange(start, device=qpos.device).expand(B, start)
        kpos = torch.cat([prefix, qpos], dim=1)  # (B, start + n)
        out_of_window = (qpos[:, :, None] - kpos[:, None, :]) >= self.window  # (B, n, S)
        windowed = mask.masked_fill(out_of_window[:, None], torch.finfo(mask.dtype).min)
        if self.per_kind:
            return {FULL: mask, SLIDING: windowed}
        return windowed
