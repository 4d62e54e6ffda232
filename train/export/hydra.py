"""format=hydra: heads in the layout of github.com/zankner/Hydra (`hydra_lm_head.pt`).

`hydra_lm_head.pt` (a `torch.save`d state dict of its `HydraMLP`, hydra_head_arch=mlp) and a
`config.json` with the keys its `HydraConfig` reads. Read from zankner/Hydra
(`hydra/model/hydra_heads/prefix_mlp_head.py`, `hydra/train/train.py`) and from copies of its
`hydra/model/hydra_heads/mlp_head.py` and `hydra/model/hydra_model.py`. Head k (0-based),
block j (0-based), L = num_layers, K = num_heads, H = hidden size, V = vocab:

| zankner/Hydra (`hydra_lm_head.pt`)            | ours (`heads.safetensors`)              |
|-----------------------------------------------|-----------------------------------------|
| `hydra_mlp.{k}.{j}.linear.weight` / `.bias`   | `mlps.{k}.{j}.linear.weight` / `.bias`  |
| `hydra_mlp.{k}.0.res_connection.weight`       | `mlps.{k}.0.proj.weight` (grounded)     |
| `hydra_mlp.{k}.0.res_connection.bias`         | `mlps.{k}.0.proj.bias` (head.bias=true) |
| `hydra_lm_head.{k}.weight`                    | `lm_heads.{k}.weight`                   |
| `hydra_lm_head.{k}.bias`                      | `lm_heads.{k}.bias` (head.bias=true)    |
| `input_embed_fn.weight` (the base embedding)  | not written; their loader is non-strict |

| `config.json` key          | value                                                   |
|----------------------------|---------------------------------------------------------|
| `hydra_num_heads`          | K                                                       |
| `hydra_num_layers`         | L                                                       |
| `hydra_head_arch`          | `mlp`                                                   |
| `grounded_heads`           | true for our `hydra`, false for our `medusa`            |
| `hidden_state_offset`      | `head.hidden_state_offset` (same meaning)               |
| `base_model_name_or_path`  | the base's hub id (or `base_model=`)                    |

Refused: `hydra_pp` (their Hydra++, hydra_head_arch=prefix-mlp, runs a one-layer `LlamaModel`,
whose final RMSNorm our extra layer does not have); a draft vocab (their lm heads score all V
tokens, with no token map); blocks their code ties together: `HydraMLP` repeats one `ResBlock`
object (`[ResBlock(H)] * n`), so blocks 1..L-1 of a grounded head, and all L blocks of an
ungrounded head, share weights there; ours are exported only if they are equal. On import, a
non-zero `res_connection` or `hydra_lm_head` bias (their nn.Linear default, trained) makes the
imported heads `head.bias=true`; heads without biases are exported with zero biases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from train.export.common import FormatError, _head, _int, _Parsed, _read_json, _Take, _zero_bias
from train.heads import HeadSet

HYDRA_WEIGHTS = "hydra_lm_head.pt"


def _names(k_heads: int, n_layers: int, grounded: bool) -> list[tuple[str, str]]:
    """(ours, theirs) for every tensor of the table above, head by head."""
    layers = []
    for k in range(k_heads):
        layers += [(f"mlps.{k}.{j}.linear", f"hydra_mlp.{k}.{j}.linear") for j in range(n_layers)]
        if grounded:
            layers.append((f"mlps.{k}.0.proj", f"hydra_mlp.{k}.0.res_connection"))
        layers.append((f"lm_heads.{k}", f"hydra_lm_head.{k}"))
    return [(f"{o}.{p}", f"{t}.{p}") for o, t in layers for p in ("weight", "bias")]


def files(heads: HeadSet, base_id: str) -> dict[str, Any]:
    """The format=hydra export of `heads` trained on `base_id`: file name -> content."""
    if heads.arch == "hydra_pp":
        raise FormatError(
            "hydra_pp heads cannot be exported as format=hydra: zankner/Hydra's Hydra++ "
            "(hydra_head_arch=prefix-mlp) runs its extra layer as a one-layer LlamaModel, which "
            "applies a final RMSNorm (prefix_embeding_layer.norm) before the heads; our Hydra++ "
            "layer feeds the heads its output without one, so no weights give the same "
            "proposals there. Export format=hf instead"
        )
    if heads.draft is not None:
        raise FormatError(
            f"{heads.arch} heads with a draft vocab (draft_vocab_size={heads.draft.size}) cannot "
            "be exported as format=hydra: zankner/Hydra's hydra_lm_head layers score the full "
            "vocab. Export format=hf, or train with head.draft_vocab_size=null"
        )
    grounded = heads.arch == "hydra"
    k_heads, n_layers = heads.num_heads, heads.cfg.num_layers
    sd = heads.state_dict()
    # Their HydraMLP repeats one ResBlock object for every block after the first (grounded) or
    # for all blocks (ungrounded): those blocks share weights there and must be equal here.
    first_shared = 1 if grounded else 0
    for k in range(k_heads):
        for j in range(first_shared + 1, n_layers):
            block, shared = f"mlps.{k}.{j}.linear.", f"mlps.{k}.{first_shared}.linear."
            if not all(torch.equal(sd[block + p], sd[shared + p]) for p in ("weight", "bias")):
                kind = "grounded" if grounded else "ungrounded"
                raise FormatError(
                    f"{heads.arch} heads with num_layers={n_layers} cannot be exported as "
                    f"format=hydra: zankner/Hydra's HydraMLP builds blocks {first_shared}.."
                    f"{n_layers - 1} of a {kind} head from one repeated ResBlock, so they "
                    f"share weights there, but block {j} of head {k} differs from block "
                    f"{first_shared}. It runs {kind} heads of num_layers <= "
                    f"{first_shared + 1} as trained; export format=hf instead"
                )
    # heads without biases (head.bias=false) are written with zero ones where theirs have them
    names = _names(k_heads, n_layers, grounded)
    state = {t: sd[o] if o in sd else _zero_bias(sd, o) for o, t in names}
    config = {
        "hydra_num_heads": k_heads,
        "hydra_num_layers": n_layers,
        "hydra_head_arch": "mlp",
        "grounded_heads": grounded,
        "hidden_state_offset": heads.cfg.hidden_state_offset,
        "base_model_name_or_path": base_id,
    }
    return {"config.json": json.dumps(config, indent=2) + "\n", HYDRA_WEIGHTS: state}


def read(src: Path) -> _Parsed:
    """The zankner/Hydra checkpoint in directory `src`, in our terms."""
    cfg_path = src / "config.json"
    cfg = _read_json(cfg_path)
    # Defaults are those of zankner/Hydra's HydraConfig, which its loader applies too.
    arch = cfg.get("hydra_head_arch", "mlp")
    if arch != "mlp":
        why = {
            "prefix-mlp": "its Hydra++ layer is a one-layer LlamaModel with a final RMSNorm that "
            "our Hydra++ layer lacks",
        }.get(arch, "our heads have no counterpart of that architecture")
        raise FormatError(
            f"{cfg_path}: hydra_head_arch = {arch!r} cannot be imported: {why}; only "
            "hydra_head_arch='mlp' maps exactly onto our heads"
        )
    k_heads = _int(cfg, "hydra_num_heads", 4, cfg_path)
    n_layers = _int(cfg, "hydra_num_layers", 1, cfg_path)
    offset = _int(cfg, "hidden_state_offset", 0, cfg_path)
    grounded = bool(cfg.get("grounded_heads", False))
    take = _Take(src / HYDRA_WEIGHTS)
    ours: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor | None] = {}
    for o, t in _names(k_heads, n_layers, grounded):
        if o.endswith(".bias") and ".linear." not in o:  # ours have it only with head.bias=true
            biases[o] = take(t, optional=True)
        else:
            ours[o] = take(t)
    take.done(ignore=("input_embed_fn.weight",))  # the base's own embedding table
    # Their nn.Linear layers keep (and train) a bias: heads with any non-zero one are imported
    # with head.bias=true, all others as our plain heads.
    has_bias = any(b is not None and torch.count_nonzero(b) for b in biases.values())
    if has_bias:
        for key, b in biases.items():
            ours[key] = b if b is not None else _zero_bias(ours, key)
    vocab, hidden = ours["lm_heads.0.weight"].shape
    settings = {"num_heads": k_heads, "num_layers": n_layers, "hidden_state_offset": offset}
    head = _head("hydra" if grounded else "medusa", **settings, bias=has_bias)
    return _Parsed(head, hidden, vocab, ours, str(cfg.get("base_model_name_or_path", "?")))
