"""format=eagle3 and format=speculators: EAGLE-3 drafts in the layouts serving engines load.

`eagle3` is SafeAILab/EAGLE's own layout (traineagle3), which SGLang (`LlamaForCausalLMEagle3`,
`--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`) and vLLM
(`speculative_config={"method": "eagle3", "model": DIR}`) both read; `speculators` is
vllm-project/speculators' layout, which vLLM also reads and serves alone
(`vllm serve DIR`: the verifier is named in its config). The same tensors, two sets of names:

| ours                   | eagle3 (`model.safetensors`) | speculators (`model.safetensors`) |
|------------------------|------------------------------|-----------------------------------|
| `fc.weight`            | `fc.weight`                  | `fc.weight`                       |
| `layer.{name}`         | `midlayer.{name}`            | `layers.0.{name}`                 |
| `norm.weight`          | `norm.weight`                | `norm.weight`                     |
| `lm_heads.0.weight`    | `lm_head.weight`             | `lm_head.weight`                  |
| `draft.to_full`        | `d2t` (int64), `t2d` (bool)  | `d2t`, `t2d`                      |

`{name}`: `input_layernorm`, `hidden_norm`, `post_attention_layernorm`, `self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj` (`.weight`). `d2t[i] = target_id - i` for draft id i, so the engines map
a draft token to `i + d2t[i]`; `t2d` marks the target ids in the draft vocab. A full-vocab draft is
written with `d2t` all zero and `t2d` all true. Neither file holds the embedding table: the
engines share the base's, as ours does.

`config.json` (eagle3): a one-layer Llama config with the base's attention shape,
`architectures` = [LlamaForCausalLMEagle3], `draft_vocab_size`, `target_hidden_size`. The fused
layers are written only when they differ from EAGLE-3's default (2, N // 2, N - 3), as
`eagle_aux_hidden_state_layer_ids` (top level and in `eagle_config`) in vLLM's meaning (the
input of layer i, our `head.aux_layers`); SGLang reads that field one layer later, so a draft
with other layers runs as trained in vLLM only (a note says so). (speculators):
`speculators_model_type` = eagle3, `transformer_layer_config`, `draft_vocab_size`,
`norm_before_residual` = false (EAGLE-3's residual; vLLM assumes true when the key is missing),
`target_hidden_size`, `speculators_config` naming the verifier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from train.export.common import FormatError, Parsed, Take, head_config, read_json
from train.heads import HeadSet
from train.heads.blocks import layer_config
from train.heads.eagle3 import default_aux_layers

WEIGHTS = "model.safetensors"
LAYER_TENSORS = [
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
]
PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}


def _names(layout: str) -> list[tuple[str, str]]:
    """(ours, theirs) for every weight of the table above."""
    layer = [(f"layer.{n}", PREFIX[layout] + n) for n in LAYER_TENSORS]
    return [("fc.weight", "fc.weight"), *layer, ("norm.weight", "norm.weight"),
            ("lm_heads.0.weight", "lm_head.weight")]  # fmt: skip


def vocab_maps(heads: HeadSet) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the heads' draft vocab (the identity for a full-vocab draft)."""
    V = heads.vocab_size
    if heads.draft is None:
        return torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    to_full = heads.draft.to_full.long().cpu()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[to_full] = True
    return to_full - torch.arange(to_full.numel()), t2d


def llama_fields(heads: HeadSet) -> dict[str, Any]:
    """The one-layer Llama config of the draft layer, in the field names engines read."""
    shape = {**heads.base_shape, "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size}
    c = layer_config(shape)
    rope = dict(c.rope_parameters or {})
    fields: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": heads.vocab_size,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(heads.fc.weight.dtype).removeprefix("torch."),
    }
    if rope.get("rope_type", "default") != "default":  # e.g. Llama 3's: the engines' v4 name
        fields["rope_scaling"] = rope
    return fields


def files(heads: HeadSet, base_id: str, layout: str, notes: list[str]) -> dict[str, Any]:
    """The format=eagle3 / speculators export of `heads`: file name -> content, + notes."""
    if heads.arch != "eagle3":
        raise FormatError(
            f"{heads.arch} heads cannot be exported as format={layout}: it is EAGLE-3's layout "
            "(fused base layers, one decoder layer over [embedding; feature], a draft lm head), "
            "and only head=eagle3 computes that. Export format=hf, format=hydra (Hydra's heads) "
            "or format=medusa"
        )
    if len(heads.aux_layers) != 3:
        raise FormatError(
            f"eagle3 heads fusing {len(heads.aux_layers)} layers ({list(heads.aux_layers)}) cannot "
            f"be exported as format={layout}: the engines fuse exactly three (fc: 3H -> H). "
            "Train with three head.aux_layers (default: 2, N/2, N-3), or export format=hf"
        )
    sd = heads.state_dict()
    state = {t: sd[o] for o, t in _names(layout)}
    state["d2t"], state["t2d"] = vocab_maps(heads)
    n_layers = int(heads.base_shape.get("num_hidden_layers") or 0)
    default = n_layers and tuple(heads.aux_layers) == default_aux_layers(n_layers)
    aux = None if default else list(heads.aux_layers)
    llama = llama_fields(heads)
    draft_size = int(state["d2t"].numel())
    if layout == "eagle3":
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **llama,
            "draft_vocab_size": draft_size,
            "target_hidden_size": heads.hidden_size,
            "base_model_name_or_path": base_id,
        }
        if aux is not None:  # vLLM reads it at the top level or in eagle_config
            config["eagle_aux_hidden_state_layer_ids"] = aux
            config["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": aux,
                "use_aux_hidden_state": True,
            }
            notes.append(
                f"aux layers {aux} differ from EAGLE-3's default: vLLM reads them as written; "
                "SGLang reads eagle_aux_hidden_state_layer_ids one layer later, so serve this "
                "draft with vLLM, or train with head.aux_layers=null"
            )
    else:
        config = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": draft_size,
            "norm_before_residual": False,
            "target_hidden_size": heads.hidden_size,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": heads.draft_depth,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": base_id, "architectures": ["LlamaForCausalLM"]},
            },
        }
        if aux is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux
    return {"config.json": json.dumps(config, indent=2) + "\n", WEIGHTS: state}


def read(src: Path) -> Parsed:
    """An EAGLE-3 draft in either layout (speculators when its config says so), in our terms."""
    cfg_path = src / "config.json"
    cfg = read_json(cfg_path)
    speculators = cfg.get("speculators_model_type") is not None
    if speculators and cfg["speculators_model_type"] != "eagle3":
        raise FormatError(
            f"{cfg_path}: speculators_model_type = {cfg['speculators_model_type']!r}; only eagle3 "
            "drafts map onto ours (head=eagle3)"
        )
    if speculators and cfg.get("norm_before_residual", True):
        raise FormatError(
            f"{cfg_path}: norm_before_residual is true (or missing, which vLLM reads as true): "
            "that draft adds its attention to the normalised feature, EAGLE-3's own (and ours) "
            "to the raw one, so ours cannot compute it"
        )
    for key in ("norm_before_fc", "fc_norm", "norm_output"):  # speculators' variants
        if cfg.get(key):
            raise FormatError(
                f"{cfg_path}: {key} is true: that draft normalises where EAGLE-3 (and ours) "
                "does not, so ours cannot compute it"
            )
    layout = "speculators" if speculators else "eagle3"
    llama = cfg.get("transformer_layer_config", {}) if speculators else cfg
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    weights = src / WEIGHTS
    if not weights.is_file() and (src / "pytorch_model.bin").is_file():
        weights = src / "pytorch_model.bin"  # what SafeAILab's traineagle3 saves
    take = Take(weights, strip="model.")
    if take("layers.0.fc.weight", optional=True) is not None:  # never written so; say it
        raise FormatError(f"{weights}: fc inside layers.0 is not an EAGLE-3 layout")
    ours = {o: take(t) for o, t in _names(layout)}
    d2t = take("d2t", optional=True)
    take.done(ignore=("t2d", "embed_tokens.weight"), ignore_suffix="rotary_emb.inv_freq")
    draft, H = ours["lm_heads.0.weight"].shape
    vocab = int(llama.get("vocab_size") or draft)
    if d2t is not None and not (draft == vocab and not d2t.any()):
        ours["draft.to_full"] = d2t.long() + torch.arange(draft)
    head = head_config(
        "eagle3",
        aux_layers=None if ids is None else [int(i) for i in ids],
        draft_vocab_size=None if "draft.to_full" not in ours else draft,
        init="official",
    )
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    base_id = cfg.get("base_model_name_or_path") or verifier.get("name_or_path") or "?"
    return Parsed(head, H, vocab, ours, str(base_id))
