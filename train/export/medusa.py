"""format=medusa: Medusa heads in the layouts vLLM, TensorRT-LLM and FasterDecoding/Medusa load.

Medusa heads only. `config.json` + `model.safetensors` in vLLM's names
(`vllm/model_executor/models/medusa.py`, `vllm/transformers_utils/configs/medusa.py`), and, for
full-vocab heads, `medusa_lm_head.safetensors` in FasterDecoding/Medusa's names, which is what
TensorRT-LLM's Medusa converter reads (`tensorrt_llm/models/medusa/weight.py`, keys
`medusa_num_heads` / `medusa_num_layers` of the same `config.json`):

| ours                         | vLLM (`model.safetensors`)     | TensorRT-LLM (`medusa_lm_head`) |
|------------------------------|--------------------------------|---------------------------------|
| `mlps.{k}.{j}.linear.weight` | `blocks.{k}.layers.{j}.weight` | `{k}.{j}.linear.weight`         |
| `mlps.{k}.{j}.linear.bias`   | `blocks.{k}.layers.{j}.bias`   | `{k}.{j}.linear.bias`           |
| `lm_heads.{k}.weight`        | `lm_heads.{k}.weight`          | `{k}.{L}.weight`                |
| `draft.to_full`              | `token_map` (int64)            | none: it has no draft vocab     |

`config.json`: `architectures` = [MedusaModel], `model_type` = medusa, `hidden_size`,
`vocab_size`, `num_heads`, `num_hidden_layers`, `medusa_fc_bias` = true (vLLM's blocks have no
bias unless it is set), `truncated_vocab_size` (draft vocab only), `medusa_num_heads`,
`medusa_num_layers`, `base_model_name_or_path`. Refused: hydra / hydra_pp heads (no engine runs
sequentially dependent heads) and `hidden_state_offset` > 0 (the engines feed the heads the
base's last hidden state). FasterDecoding/Medusa's own `MedusaModel` also ties a head's L
blocks (`[ResBlock(H)] * L`), so with L > 1 only vLLM and TensorRT-LLM run the file as trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from train.core.errors import NotFound
from train.export.common import FormatError, Parsed, Take, as_int, head_config, read_json, zero_bias
from train.heads import HeadSet

MEDUSA_TRT_WEIGHTS = "medusa_lm_head.safetensors"


def _names(k_heads: int, n_layers: int) -> list[tuple[str, str, str]]:
    """(ours, vLLM, TensorRT-LLM) for every tensor of the table above, head by head."""
    names = []
    for k in range(k_heads):
        for j in range(n_layers):
            ours, vllm, trt = f"mlps.{k}.{j}.linear.", f"blocks.{k}.layers.{j}.", f"{k}.{j}.linear."
            names += [(ours + p, vllm + p, trt + p) for p in ("weight", "bias")]
        names.append((f"lm_heads.{k}.weight", f"lm_heads.{k}.weight", f"{k}.{n_layers}.weight"))
    return names


def files(heads: HeadSet, base_id: str, notes: list[str]) -> dict[str, Any]:
    """The format=medusa export of `heads` trained on `base_id`: file name -> content, + notes."""
    if heads.arch != "medusa":
        raise FormatError(
            f"{heads.arch} heads cannot be exported as format=medusa: vLLM and TensorRT-LLM run "
            "Medusa heads, K independent MLPs on the base's hidden state evaluated in one pass, "
            "and no engine runs sequentially dependent heads (each Hydra head reads the "
            "embeddings of the tokens proposed before it). Export format=hydra (zankner/Hydra) "
            "or format=hf"
        )
    if heads.cfg.bias:
        raise FormatError(
            "medusa heads with head.bias=true cannot be exported as format=medusa: the lm heads "
            "of vLLM's and TensorRT-LLM's Medusa have no bias. Export format=hydra or format=hf"
        )
    if heads.cfg.hidden_state_offset:
        raise FormatError(
            f"medusa heads with hidden_state_offset={heads.cfg.hidden_state_offset} cannot be "
            "exported as format=medusa: vLLM and TensorRT-LLM feed Medusa heads the base's last "
            "(post-norm) hidden state. Export format=hydra or format=hf, or train with offset 0"
        )
    sd = heads.state_dict()
    k_heads, n_layers = heads.num_heads, heads.cfg.num_layers
    names = _names(k_heads, n_layers)
    vllm, trt = {v: sd[o] for o, v, _ in names}, {t: sd[o] for o, _, t in names}
    config: dict[str, Any] = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": k_heads,
        "num_hidden_layers": n_layers,
        "medusa_fc_bias": True,  # our blocks have a bias; vLLM adds one only when this is set
        # TensorRT-LLM and FasterDecoding/Medusa read these two names
        "medusa_num_heads": k_heads,
        "medusa_num_layers": n_layers,
        "base_model_name_or_path": base_id,
    }
    out: dict[str, Any] = {"model.safetensors": vllm}
    if heads.draft is not None:
        config["truncated_vocab_size"] = heads.draft.size
        vllm["token_map"] = heads.draft.to_full.long()
        notes.append(
            f"{MEDUSA_TRT_WEIGHTS} (TensorRT-LLM) not written: it has no draft vocab; "
            "vLLM reads model.safetensors with its token_map"
        )
    else:
        out[MEDUSA_TRT_WEIGHTS] = trt
    out["config.json"] = json.dumps(config, indent=2) + "\n"
    return out


def read(src: Path) -> Parsed:
    """The Medusa heads in directory `src` (vLLM's layout, else FasterDecoding's), in our terms."""
    cfg = read_json(src / "config.json")
    base_id = str(cfg.get("base_model_name_or_path", "?"))
    if (src / "model.safetensors").is_file():
        return _read_vllm(src, cfg, base_id)
    for name in (MEDUSA_TRT_WEIGHTS, "medusa_lm_head.pt"):
        if (src / name).is_file():
            return _read_fasterdecoding(src / name, cfg, base_id)
    raise NotFound(
        f"{src} has no Medusa weights: expected model.safetensors (vLLM), "
        f"{MEDUSA_TRT_WEIGHTS} or medusa_lm_head.pt (FasterDecoding/Medusa, TensorRT-LLM)"
    )


def _read_vllm(src: Path, cfg: dict, base_id: str) -> Parsed:
    where = src / "config.json"
    # vLLM's MedusaConfig takes any "num*heads" / "num*layers" key as num_heads / num_layers.
    k_heads = as_int(cfg, "num_heads", cfg.get("medusa_num_heads"), where)
    n_layers = as_int(cfg, "num_hidden_layers", cfg.get("medusa_num_layers", 1), where)
    vocab = as_int(cfg, "vocab_size", None, where)
    truncated = as_int(cfg, "truncated_vocab_size", vocab, where)
    take = Take(src / "model.safetensors", src, strip="medusa_heads.")
    token_map = take("token_map", optional=True)
    if truncated < vocab and token_map is None:
        raise FormatError(
            f"{where}: truncated_vocab_size={truncated} < vocab_size={vocab} "
            "but model.safetensors has no token_map"
        )
    draft = token_map.long() if truncated < vocab else None  # vLLM ignores it otherwise
    shared = cfg.get("original_lm_head", False)  # one lm head for every Medusa head
    shared_lm = None
    if shared:  # vLLM reads it as lm_head.weight, or as lm_heads.0.weight from Medusa's files
        shared_lm = take("lm_head.weight", optional=True)
        if shared_lm is None:
            shared_lm = take("lm_heads.0.weight")
    ours: dict[str, torch.Tensor] = {}
    for o, v, _ in _names(k_heads, n_layers):
        if o.startswith("lm_heads."):
            lm = shared_lm if shared else take(v)
            if draft is not None and lm.shape[0] > draft.numel():  # full rows: vLLM slices too
                lm = lm[draft]
            ours[o] = lm.clone() if shared else lm
        else:  # a block; its bias is absent with medusa_fc_bias=false
            t = take(v, optional=o.endswith(".bias"))
            ours[o] = zero_bias(ours, o) if t is None else t
    take.done()
    if draft is not None:
        ours["draft.to_full"] = draft
    hidden = ours["mlps.0.0.linear.weight"].shape[1]
    draft_size = None if draft is None else int(draft.numel())
    head = head_config(  # each block its own tensors in the file: untied, as before
        "medusa",
        num_heads=k_heads,
        num_layers=n_layers,
        draft_vocab_size=draft_size,
        tie_blocks=False,
    )
    return Parsed(head, hidden, vocab, ours, base_id)


def _read_fasterdecoding(path: Path, cfg: dict, base_id: str) -> Parsed:
    where = path.parent / "config.json"
    n_layers = as_int(cfg, "medusa_num_layers", cfg.get("num_hidden_layers", 1), where)
    k_heads = as_int(cfg, "medusa_num_heads", cfg.get("num_heads"), where)
    take = Take(path)
    ours = {o: take(t) for o, _, t in _names(k_heads, n_layers)}
    take.done()
    vocab, hidden = ours["lm_heads.0.weight"].shape
    head = head_config("medusa", num_heads=k_heads, num_layers=n_layers, tie_blocks=False)
    return Parsed(head, hidden, vocab, ours, base_id)
