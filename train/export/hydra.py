"""format=hydra: heads in the layout of github.com/zankner/Hydra (`hydra_lm_head.pt`).

`hydra_lm_head.pt` (a `torch.save`d state dict of its head module) and a `config.json` with the
keys its `HydraConfig` reads, read from zankner/Hydra (`hydra/model/hydra_heads/mlp_head.py`,
`prefix_mlp_head.py`, `hydra/model/hydra_model.py`, `hydra/train/train.py`). Our `medusa` and
`hydra` heads are its `HydraMLP` (hydra_head_arch=mlp, grounded_heads false / true); our
`hydra_pp` is its `HydraPrefixMLP` (hydra_head_arch=prefix-mlp, grounded), whose
`nn.Sequential`s hold a Dropout before every block and lm head, so block j sits at index 2j+1
and an lm head at index 1. Head k (0-based), block j (0-based), L = num_layers, K = num_heads:

| ours                    | theirs, mlp                        | theirs, prefix-mlp       |
|-------------------------|------------------------------------|--------------------------|
| `mlps.{k}.{j}.linear.*` | `hydra_mlp.{k}.{j}.linear.*`       | the same at index 2j+1   |
| `mlps.{k}.0.proj.*`     | `hydra_mlp.{k}.0.res_connection.*` | the same at index 1      |
| `lm_heads.{k}.*`        | `hydra_lm_head.{k}.*`              | `hydra_lm_head.{k}.1.*`  |
| `prefix.layers.0.*`     | -                                  | `P.layers.0.*`           |
| `prefix.norm.weight`    | -                                  | `P.norm.weight`          |
| - (ignored)             | `input_embed_fn.weight`            | the same,                |
|                         |                                    | `P.embed_tokens.weight`, |
|                         |                                    | `P.layers.0.*.inv_freq`  |

P is `prefix_embeding_layer` (their spelling); `.*` is `.weight` and `.bias`. The ignored
tensors (the base's own embeddings, an unused table, buffers) are not written, and skipped when
read. `proj.bias` and `lm_heads.{k}.bias` exist with head.bias=true only: heads without biases
are written with zero ones, and a checkpoint whose `res_connection` / lm-head biases are not all
zero (their nn.Linear default, trained) is read as head.bias=true heads.

| `config.json` key          | value                                                          |
|----------------------------|----------------------------------------------------------------|
| `hydra_num_heads`          | K                                                              |
| `hydra_num_layers`         | L                                                              |
| `hydra_head_arch`          | `mlp` (medusa, hydra) or `prefix-mlp` (hydra_pp)               |
| `grounded_heads`           | false for medusa, true for hydra and hydra_pp                  |
| `hidden_state_offset`      | `head.hidden_state_offset` (same meaning)                      |
| `base_model_name_or_path`  | the base's hub id (or `base_model=`)                           |

Their code repeats one `ResBlock` object (`[ResBlock(H)] * n`): blocks 1..L-1 of a grounded
head, all L of an ungrounded one, share weights there. Heads read from it are head.tie_blocks
heads; ours are exported if those blocks are equal (always, with head.tie_blocks=true).
Refused: a draft vocab (their lm heads score all V tokens, with no token map), blocks that
differ where theirs are one, and an ungrounded prefix-mlp (we have no Medusa over an extra layer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from train.export.common import FormatError, Parsed, Take, as_int, head_config, read_json, zero_bias
from train.heads import HeadSet

HYDRA_WEIGHTS = "hydra_lm_head.pt"


PREFIX = ("prefix.", "prefix_embeding_layer.")  # our name prefix, theirs
PREFIX_TENSORS = [
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
    "norm.weight",
]
IGNORED = ("input_embed_fn.weight", "prefix_embeding_layer.embed_tokens.weight")


def _names(k_heads: int, n_layers: int, grounded: bool, prefix: bool) -> list[tuple[str, str]]:
    """(ours, theirs) for every tensor of the tables above, head by head."""
    block = (lambda j: 2 * j + 1) if prefix else (lambda j: j)  # Dropouts sit between blocks
    layers = []
    for k in range(k_heads):
        layers += [
            (f"mlps.{k}.{j}.linear", f"hydra_mlp.{k}.{block(j)}.linear") for j in range(n_layers)
        ]
        if grounded:
            layers.append((f"mlps.{k}.0.proj", f"hydra_mlp.{k}.{block(0)}.res_connection"))
        layers.append((f"lm_heads.{k}", f"hydra_lm_head.{k}" + (".1" if prefix else "")))
    names = [(f"{o}.{p}", f"{t}.{p}") for o, t in layers for p in ("weight", "bias")]
    return names + [(PREFIX[0] + n, PREFIX[1] + n) for n in (PREFIX_TENSORS if prefix else [])]


# hydra_eagle <-> their EagleAttentionDecoderLayer (hydra_head_arch=eagle-attn): the same names
# for `fc.*` and the decoder layer `attn.*`; our frozen lm head is theirs, the base's
# `lm_head` (registered in their module, so saved with it; their `input_embed_fn` is the
# base's embedding table, not written, skipped when read, as their loader's strict=False allows)
EAGLE_TENSORS = [
    "fc.weight",
    "fc.bias",
    *(f"attn.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"attn.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "attn.input_layernorm.weight",
    "attn.post_attention_layernorm.weight",
]
EAGLE_NAMES = [(n, n) for n in EAGLE_TENSORS] + [("lm_heads.0.weight", "lm_head.weight")]
# hydra_cross_attn <-> their HydraCrossAttentionDecoderLayer (hydra_head_arch=cross-attn): the
# same names, the lm head as for eagle-attn
CROSS_TENSORS = [
    *(f"cross_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
CROSS_NAMES = [(n, n) for n in CROSS_TENSORS] + [("lm_heads.0.weight", "lm_head.weight")]
# our arch -> (their hydra_head_arch, tensor names) for the one-layer recurrent heads
RECURRENT_ARCH = {
    "hydra_eagle": ("eagle-attn", EAGLE_NAMES),
    "hydra_cross_attn": ("cross-attn", CROSS_NAMES),
}


def files(heads: HeadSet, base_id: str) -> dict[str, Any]:
    """The format=hydra export of `heads` trained on `base_id`: file name -> content."""
    if heads.recurrent and heads.arch not in RECURRENT_ARCH:
        raise FormatError(
            f"{heads.arch} heads cannot be exported as format=hydra: zankner/Hydra has no "
            f"{heads.arch} module (its hydra_head_arch values are mlp, prefix-mlp, eagle-attn "
            "and cross-attn). Export format=eagle3 (SGLang, vLLM), format=speculators (vLLM) "
            "or format=hf"
        )
    if heads.draft is not None:
        raise FormatError(
            f"{heads.arch} heads with a draft vocab (draft_vocab_size={heads.draft.size}) cannot "
            "be exported as format=hydra: zankner/Hydra's hydra_lm_head layers score the full "
            "vocab. Export format=hf, or train with head.draft_vocab_size=null"
        )
    if heads.arch in RECURRENT_ARCH:
        arch, names = RECURRENT_ARCH[heads.arch]
        sd = heads.state_dict()
        config = {
            "hydra_num_heads": 1,
            "hydra_num_layers": 1,
            "hydra_head_arch": arch,
            "grounded_heads": True,
            "hidden_state_offset": heads.cfg.hidden_state_offset,
            "base_model_name_or_path": base_id,
        }
        state = {t: sd[o] for o, t in names}
        return {"config.json": json.dumps(config, indent=2) + "\n", HYDRA_WEIGHTS: state}
    grounded, prefix = heads.arch != "medusa", heads.arch == "hydra_pp"
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
    names = _names(k_heads, n_layers, grounded, prefix)
    state = {t: sd[o] if o in sd else zero_bias(sd, o) for o, t in names}
    config = {
        "hydra_num_heads": k_heads,
        "hydra_num_layers": n_layers,
        "hydra_head_arch": "prefix-mlp" if prefix else "mlp",
        "grounded_heads": grounded,
        "hidden_state_offset": heads.cfg.hidden_state_offset,
        "base_model_name_or_path": base_id,
    }
    return {"config.json": json.dumps(config, indent=2) + "\n", HYDRA_WEIGHTS: state}


def read(src: Path) -> Parsed:
    """The zankner/Hydra checkpoint in directory `src`, in our terms."""
    cfg_path = src / "config.json"
    cfg = read_json(cfg_path)
    # Defaults are those of zankner/Hydra's HydraConfig, which its loader applies too.
    arch = cfg.get("hydra_head_arch", "mlp")
    grounded = bool(cfg.get("grounded_heads", False))
    known = arch in ("mlp", "prefix-mlp", "eagle-attn", "cross-attn")
    if not known or (arch != "mlp" and not grounded):
        what = f"hydra_head_arch = {arch!r}, grounded_heads = {str(grounded).lower()}"
        raise FormatError(
            f"{cfg_path}: {what} cannot be imported: our heads have no counterpart of it; mlp "
            "(medusa, hydra), grounded prefix-mlp (hydra_pp), eagle-attn (hydra_eagle) and "
            "cross-attn (hydra_cross_attn) map exactly onto ours"
        )
    if arch in ("eagle-attn", "cross-attn"):
        return _read_recurrent(src, cfg, cfg_path, arch)
    prefix = arch == "prefix-mlp"
    k_heads = as_int(cfg, "hydra_num_heads", 4, cfg_path)
    n_layers = as_int(cfg, "hydra_num_layers", 1, cfg_path)
    offset = as_int(cfg, "hidden_state_offset", 0, cfg_path)
    take = Take(src / HYDRA_WEIGHTS)
    ours: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor | None] = {}
    for o, t in _names(k_heads, n_layers, grounded, prefix):
        if o.endswith(".bias") and ".linear." not in o:  # ours have it only with head.bias=true
            biases[o] = take(t, optional=True)
        else:
            ours[o] = take(t)
    take.done(ignore=IGNORED, ignore_suffix="rotary_emb.inv_freq")
    # Their nn.Linear layers keep (and train) a bias: heads with any non-zero one are imported
    # with head.bias=true, all others as our plain heads.
    has_bias = any(b is not None and torch.count_nonzero(b) for b in biases.values())
    if has_bias:
        for key, b in biases.items():
            ours[key] = b if b is not None else zero_bias(ours, key)
    vocab, hidden = ours["lm_heads.0.weight"].shape
    settings = {"num_heads": k_heads, "num_layers": n_layers, "hidden_state_offset": offset}
    name = "hydra_pp" if prefix else "hydra" if grounded else "medusa"
    # their blocks after the first are one module: ours tied too, so training keeps them so
    head = head_config(name, **settings, bias=has_bias, tie_blocks=True, init="official")
    return Parsed(head, hidden, vocab, ours, str(cfg.get("base_model_name_or_path", "?")))


def _read_recurrent(src: Path, cfg: dict, cfg_path: Path, arch: str) -> Parsed:
    """An eagle-attn or cross-attn checkpoint: one head of one layer."""
    name, names = next((o, n) for o, (a, n) in RECURRENT_ARCH.items() if a == arch)
    for key in ("hydra_num_heads", "hydra_num_layers"):
        if as_int(cfg, key, 1, cfg_path) != 1:
            raise FormatError(
                f"{cfg_path}: {key} = {cfg[key]} for {arch}, whose module asserts 1: "
                "the file is not one zankner/Hydra wrote"
            )
    offset = as_int(cfg, "hidden_state_offset", 0, cfg_path)
    take = Take(src / HYDRA_WEIGHTS)
    ours = {o: take(t) for o, t in names}
    take.done(ignore=IGNORED, ignore_suffix="rotary_emb.inv_freq")
    vocab, hidden = ours["lm_heads.0.weight"].shape
    settings = {"num_heads": 1, "num_layers": 1, "hidden_state_offset": offset}
    head = head_config(name, **settings, bias=False, tie_blocks=True, init="official")
    return Parsed(head, hidden, vocab, ours, str(cfg.get("base_model_name_or_path", "?")))
