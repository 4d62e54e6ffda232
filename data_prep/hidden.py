"""Offline mode: run the frozen base once over prepared samples and store its hidden states."""

from __future__ import annotations

import numpy as np
import torch

from train.core.base import BaseConfig, load_base


@torch.no_grad()
def cache_hidden_states(dd, base_cfg: BaseConfig, batch_size: int, device: str):
    """Add a `hidden` column (T, H) fp16: the base's last (post-norm) hidden state per token.

    Training reads it instead of running the base (`data.offline=true`); the teacher logits are
    that state through the frozen lm_head, so they match online training up to fp16 rounding.
    Samples are batched by similar length to waste little compute on padding.
    """
    from datasets import Array2D, Dataset, DatasetDict

    base = load_base(base_cfg, device=device)
    pad = base.tokenizer.pad_token_id or 0
    H = base.hidden_size

    def fwd(batch):
        ids_list = batch["input_ids"]
        T = max(len(x) for x in ids_list)
        ids = torch.full((len(ids_list), T), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, x in enumerate(ids_list):
            ids[i, : len(x)] = torch.as_tensor(np.asarray(x))
            attn[i, : len(x)] = 1
        out = base.model.model(
            input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False
        )
        h = out.last_hidden_state.float().cpu().numpy().astype(np.float16)
        return {"hidden": [h[i, : len(x)] for i, x in enumerate(ids_list)]}

    out = {}
    for split, ds in dd.items():
        feats = ds.features.copy()
        feats["hidden"] = Array2D(shape=(None, H), dtype="float16")
        if len(ds) == 0:
            out[split] = Dataset.from_dict({k: [] for k in feats}, features=feats)
            continue
        order = np.argsort(np.asarray(ds["length"]), kind="stable")
        tag = f"{ds._fingerprint}-hidden-{base_cfg.name}"
        cached = ds.select(order).map(
            fwd,
            batched=True,
            batch_size=batch_size,
            features=feats,
            desc=f"caching hidden states ({split})",
            new_fingerprint=tag,  # no hashing of a closure that holds the whole base model
        )
        out[split] = cached.select(np.argsort(order, kind="stable"), new_fingerprint=tag + "-o")
    return DatasetDict(out)
