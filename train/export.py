"""Convert heads checkpoints to and from the hf, hydra (zankner/Hydra) and medusa (vLLM) layouts.

Every conversion is exact or refused: a format that cannot express what our heads compute (a
bias we lack, weights their code shares, a layer they normalise) is a `FormatError` naming the
option and the fix, never a file that proposes other tokens.

## format=hf

A self-describing directory: `config.json` (`architectures`, `model_type`,
`base_model_name_or_path`, and our whole `heads_config.json`), `model.safetensors` (our own
parameter names), a `README.md` model card (with the figures of an `eval.json` when one is given
or found), and `heads_config.json` + `heads.safetensors` (the same bytes, hard-linked), so that
`hydra-heads eval heads=DIR` loads the directory as it is.

## format=hydra: the layout of github.com/zankner/Hydra

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

## format=medusa: the layout vLLM and TensorRT-LLM load

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
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from train.core.atomic import staged_dir
from train.core.base import BaseConfig, recorded_base
from train.core.checkpoint import CONFIG_FILE, FORMAT, HEADS_FILE, check_base
from train.core.config import fail, from_group
from train.core.errors import AlreadyExists, ConfigError, NotFound
from train.heads import (
    HeadConfig,
    HeadSet,
    base_shape,
    build_heads,
    heads_meta,
    load_heads,
    save_heads,
)
from train.heads.io import recorded_head

Format = Literal["hf", "hydra", "medusa"]
HF_KEYS = ("architectures", "model_type", "base_model_name_or_path", "torch_dtype")
ARCH_CLASS = {"medusa": "MedusaHeads", "hydra": "HydraHeads", "hydra_pp": "HydraPPHeads"}
ARCH_TITLE = {"medusa": "Medusa", "hydra": "Hydra", "hydra_pp": "Hydra++"}
HYDRA_WEIGHTS = "hydra_lm_head.pt"
MEDUSA_TRT_WEIGHTS = "medusa_lm_head.safetensors"


class FormatError(ConfigError):
    """Heads cannot be written in, or read from, a format without changing their proposals."""


# -- shared --------------------------------------------------------------------------------
def _check_out(out: Path, source: Path, overwrite: bool) -> None:
    o, s = out.resolve(), source.resolve()
    if o == s or o in s.parents:
        fail("out", str(out), f"it would replace the input {source}; choose another directory")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise AlreadyExists(f"{out} already exists: pass overwrite=true to replace it")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise NotFound(f"{path} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path} holds a {type(data).__name__}, expected a JSON object")
    return data


def _write_dir(out: Path, files: dict[str, Any]) -> list[str]:
    """Write `files` (name -> text | tensor dict | `_SameAs`) into `out`, atomically."""
    from safetensors.torch import save_file

    with staged_dir(out) as tmp:
        for name, content in files.items():
            path = tmp / name
            if isinstance(content, str):
                path.write_text(content)
            elif isinstance(content, _SameAs):
                try:  # a hard link: the same bytes under a second name, at no extra space
                    os.link(tmp / content.name, path)
                except OSError:
                    shutil.copyfile(tmp / content.name, path)
            elif isinstance(content, Path):
                shutil.copyfile(content, path)
            elif name.endswith(".safetensors"):
                save_file(_plain(content), str(path), metadata={"format": "pt"})
            elif name.endswith(".pt"):
                torch.save(_plain(content), path)
            else:
                raise ValueError(f"no writer for {name}")
    return sorted(files)


@dataclass
class _SameAs:
    name: str


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage; every entry gets its own.
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def recorded_base_id(meta: dict) -> str:
    """The base's hub id when it was loaded from the hub, else its config name."""
    base = meta.get("base") or {}
    cfg = base.get("config") or {}
    if cfg.get("source") == "pretrained" and cfg.get("path"):
        return str(cfg["path"])
    return str(base.get("name") or cfg.get("name") or "unknown")


def _refuse_draft(heads: HeadSet, fmt: str, why: str) -> None:
    if heads.draft is not None:
        raise FormatError(
            f"{heads.arch} heads with a draft vocab (draft_vocab_size={heads.draft.size}) "
            f"cannot be exported as format={fmt}: {why}. Export format=hf, or train with "
            "head.draft_vocab_size=null"
        )


# -- export --------------------------------------------------------------------------------
def export_heads(
    heads_dir: str | Path,
    fmt: Format,
    out: str | Path,
    *,
    eval_json: str | Path | None = None,
    base_model: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the heads checkpoint `heads_dir` to `out` in format `fmt`; returns a summary."""
    heads_dir, out = Path(heads_dir), Path(out)
    heads, meta = load_heads(heads_dir)  # no base needed: export reads the heads only
    _check_out(out, heads_dir, overwrite)
    base_id = base_model or recorded_base_id(meta)
    notes: list[str] = []
    if fmt == "hf":
        files = _hf_files(
            heads_dir, heads, meta, base_id, _eval_result(heads_dir, heads, eval_json, notes)
        )
    elif fmt == "hydra":
        files = _hydra_files(heads, base_id)
    elif fmt == "medusa":
        files = _medusa_files(heads, base_id, notes)
    else:
        fail("format", fmt, "one of hf, hydra, medusa")
    written = _write_dir(out, files)
    return {"format": fmt, "out": str(out), "arch": heads.arch, "files": written, "notes": notes}


def _hydra_files(heads: HeadSet, base_id: str) -> dict[str, Any]:
    if heads.arch == "hydra_pp":
        raise FormatError(
            "hydra_pp heads cannot be exported as format=hydra: zankner/Hydra's Hydra++ "
            "(hydra_head_arch=prefix-mlp) runs its extra layer as a one-layer LlamaModel, which "
            "applies a final RMSNorm (prefix_embeding_layer.norm) before the heads; our Hydra++ "
            "layer feeds the heads its output without one, so no weights give the same "
            "proposals there. Export format=hf instead"
        )
    _refuse_draft(heads, "hydra", "zankner/Hydra's hydra_lm_head layers score the full vocab")
    grounded = heads.arch == "hydra"
    k_heads, n_layers = heads.num_heads, heads.cfg.num_layers
    sd = heads.state_dict()
    # Their HydraMLP repeats one ResBlock object for every block after the first (grounded) or
    # for all blocks (ungrounded): those blocks share weights there and must be equal here.
    first_shared = 1 if grounded else 0
    state: dict[str, torch.Tensor] = {}
    for k in range(k_heads):
        for j in range(n_layers):
            w, b = sd[f"mlps.{k}.{j}.linear.weight"], sd[f"mlps.{k}.{j}.linear.bias"]
            if j > first_shared:
                w0 = sd[f"mlps.{k}.{first_shared}.linear.weight"]
                b0 = sd[f"mlps.{k}.{first_shared}.linear.bias"]
                if not (torch.equal(w, w0) and torch.equal(b, b0)):
                    kind = "grounded" if grounded else "ungrounded"
                    raise FormatError(
                        f"{heads.arch} heads with num_layers={n_layers} cannot be exported as "
                        f"format=hydra: zankner/Hydra's HydraMLP builds blocks {first_shared}.."
                        f"{n_layers - 1} of a {kind} head from one repeated ResBlock, so they "
                        f"share weights there, but block {j} of head {k} differs from block "
                        f"{first_shared}. It runs {kind} heads of num_layers <= "
                        f"{first_shared + 1} as trained; export format=hf instead"
                    )
            state[f"hydra_mlp.{k}.{j}.linear.weight"] = w
            state[f"hydra_mlp.{k}.{j}.linear.bias"] = b
        if grounded:
            state[f"hydra_mlp.{k}.0.res_connection.weight"] = sd[f"mlps.{k}.0.proj.weight"]
            state[f"hydra_mlp.{k}.0.res_connection.bias"] = sd.get(
                f"mlps.{k}.0.proj.bias", torch.zeros(heads.hidden_size, dtype=b.dtype)
            )
        lm = sd[f"lm_heads.{k}.weight"]
        state[f"hydra_lm_head.{k}.weight"] = lm
        state[f"hydra_lm_head.{k}.bias"] = sd.get(
            f"lm_heads.{k}.bias", torch.zeros(heads.vocab_size, dtype=lm.dtype)
        )
    config = {
        "hydra_num_heads": k_heads,
        "hydra_num_layers": n_layers,
        "hydra_head_arch": "mlp",
        "grounded_heads": grounded,
        "hidden_state_offset": heads.cfg.hidden_state_offset,
        "base_model_name_or_path": base_id,
    }
    return {"config.json": json.dumps(config, indent=2) + "\n", HYDRA_WEIGHTS: state}


def _medusa_files(heads: HeadSet, base_id: str, notes: list[str]) -> dict[str, Any]:
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
    vllm: dict[str, torch.Tensor] = {}
    trt: dict[str, torch.Tensor] = {}
    for k in range(k_heads):
        for j in range(n_layers):
            for p in ("weight", "bias"):
                t = sd[f"mlps.{k}.{j}.linear.{p}"]
                vllm[f"blocks.{k}.layers.{j}.{p}"] = t
                trt[f"{k}.{j}.linear.{p}"] = t
        vllm[f"lm_heads.{k}.weight"] = trt[f"{k}.{n_layers}.weight"] = sd[f"lm_heads.{k}.weight"]
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
    files: dict[str, Any] = {"model.safetensors": vllm}
    if heads.draft is not None:
        config["truncated_vocab_size"] = heads.draft.size
        vllm["token_map"] = heads.draft.to_full.long()
        notes.append(
            f"{MEDUSA_TRT_WEIGHTS} (TensorRT-LLM) not written: it has no draft vocab; "
            "vLLM reads model.safetensors with its token_map"
        )
    else:
        files[MEDUSA_TRT_WEIGHTS] = trt
    files["config.json"] = json.dumps(config, indent=2) + "\n"
    return files


def _hf_files(
    heads_dir: Path, heads: HeadSet, meta: dict, base_id: str, eval_res: dict | None
) -> dict[str, Any]:
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
        HEADS_FILE: _SameAs("model.safetensors"),
        "config.json": json.dumps(config, indent=2, default=str) + "\n",
        CONFIG_FILE: json.dumps(meta, indent=2, default=str) + "\n",
        "README.md": model_card(heads, meta, base_id, eval_res),
    }


def _eval_result(
    heads_dir: Path, heads: HeadSet, eval_json: str | Path | None, notes: list[str]
) -> dict | None:
    """The eval.json for the model card: the one given, else one beside the heads for them."""
    if eval_json is not None:
        res = _read_json(Path(eval_json))
        if (res.get("arch"), res.get("num_heads")) != (heads.arch, heads.num_heads):
            fail(
                "eval",
                str(eval_json),
                f"it evaluates {res.get('num_heads')} {res.get('arch')} heads, but {heads_dir} "
                f"holds {heads.num_heads} {heads.arch} heads; pass the eval.json of these heads",
            )
        notes.append(f"model card figures from {eval_json}")
        return res
    for p in (
        heads_dir / "eval.json",
        heads_dir.parent / "eval.json",
        heads_dir.parent / "eval" / "eval.json",
    ):
        if not p.is_file():
            continue
        res = _read_json(p)
        # Only an eval of these very heads: a sibling run's eval.json must not end up here.
        if res.get("heads") and Path(str(res["heads"])).resolve() == heads_dir.resolve():
            notes.append(f"model card figures from {p} (found)")
            return res
    notes.append("no eval.json given or found: the model card has no figures (pass eval=FILE)")
    return None


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def model_card(heads: HeadSet, meta: dict, base_id: str, res: dict | None) -> str:
    """README.md of an hf export: what the heads are, how to use them, how well they did."""
    title = ARCH_TITLE[heads.arch]
    desc = {
        "medusa": "K independent residual MLPs on the base model's hidden state (Cai et al., 2024)",
        "hydra": "sequentially dependent heads: head k also reads the embeddings of the tokens "
        "before its target (Ankner et al., 2024)",
        "hydra_pp": "Hydra heads over one extra causal self-attention decoder layer, "
        "distilled from the base model (Ankner et al., 2024)",
    }[heads.arch]
    front = ["---", "library_name: hydra-heads"]
    if re.fullmatch(r"[\w.-]+/[\w.-]+", base_id):  # only a hub id is a valid `base_model`
        front.append(f"base_model: {base_id}")
    front += ["tags:", "- speculative-decoding", f"- {heads.arch.replace('_', '-')}", "---", ""]
    offset = heads.cfg.hidden_state_offset
    draft = heads.draft.size if heads.draft is not None else None
    fp = meta.get("base") or {}
    rows = [
        ("architecture", f"`{heads.arch}`: {desc}"),
        ("heads x residual blocks", f"{heads.num_heads} x {heads.cfg.num_layers}"),
        ("hidden size / vocab", f"{heads.hidden_size} / {heads.vocab_size}"),
        ("draft vocab", f"{draft} most frequent training tokens" if draft else "full vocab"),
        ("base hidden state", "last (post-norm)" if offset == 0 else f"layer {offset} from last"),
        ("base model", f"`{base_id}` (shape fingerprint `{fp.get('shapes_sha256', '-')}`)"),
    ]
    training = meta.get("training") or {}
    if "steps" in training:
        rows.append(("training steps", str(training["steps"])))
    lines = [*front, f"# {title} draft heads for {base_id}", ""]
    lines += [
        f"{heads.num_heads} {title} draft heads for speculative decoding, trained with "
        "hydra-heads on a frozen base model.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {a} | {b} |" for a, b in rows),
        "",
        "## Evaluation",
        "",
    ]
    if res is None:
        lines += [
            "No evaluation figures were given. Measure them with `hydra-heads eval heads=DIR "
            "out=E` and export again with `eval=E/eval.json`.",
            "",
        ]
    else:
        tree = res.get("tree") or {}
        sampling = res.get("sampling") or {}
        prompts = res.get("prompts") or {}
        hw = res.get("hardware") or {}
        speedup = res.get("speedup")
        lines += [
            "| figure | value |",
            "|---|---|",
            f"| tau (tokens per base forward) | {_num(res.get('tau'), '.3f')} |",
            f"| speedup vs plain decoding | {_num(speedup, '.3f')}{'x' if speedup else ''} |",
            f"| tree | {tree.get('kind', '-')}: {tree.get('num_nodes', '-')} nodes, "
            f"depth {tree.get('depth', '-')} |",
            f"| prompts / generations | {prompts.get('items', '-')} / "
            f"{prompts.get('generations', '-')} |",
            f"| new tokens per generation (max) | {res.get('max_new_tokens', '-')} |",
            f"| sampling | temperature {sampling.get('temperature', '-')}, "
            f"{sampling.get('acceptance', '-')} acceptance |",
            f"| lossless (greedy == plain greedy) | "
            f"{ {True: 'yes', False: 'NO', None: 'not checked'}.get(res.get('lossless'), '-') } |",
            f"| device | {hw.get('device', '-')} ({hw.get('cpu', '-')}, torch "
            f"{hw.get('torch', '-')}) |",
            "",
        ]
        cum = res.get("acceptance_cumulative") or []
        cond = res.get("acceptance_conditional") or []
        if cum:
            lines += [
                "Acceptance per depth (cumulative: share of steps that accept at least d draft "
                "tokens; conditional: given d-1 were accepted):",
                "",
                "| depth | cumulative | conditional |",
                "|---|---|---|",
                *(
                    f"| {d} | {_num(a, '.3f')} | {_num(b, '.3f')} |"
                    for d, (a, b) in enumerate(zip(cum, cond, strict=False), 1)
                ),
                "",
            ]
    lines += [
        "## Use",
        "",
        "`config.json` + `model.safetensors` are the Hugging Face view; `heads_config.json` + "
        "`heads.safetensors` hold the same config and weights under hydra-heads' own names, so "
        "the directory is a heads checkpoint as it is:",
        "",
        "```",
        "hydra-heads eval heads=THIS_DIR eval.prompts=FILE.jsonl out=EVAL_DIR",
        "hydra-heads import src=THIS_DIR format=hf out=HEADS_DIR   # checked against the base",
        "```",
        "",
    ]
    return "\n".join(lines)


# -- import --------------------------------------------------------------------------------
@dataclass
class _Parsed:
    """A source checkpoint in our terms, before it is checked against a base."""

    head: HeadConfig
    hidden_size: int
    vocab_size: int
    state: dict[str, torch.Tensor]  # our parameter names
    base_id: str  # what the source says it was trained on
    base_shape: dict | None = None  # hf: the recorded shape (Hydra++ layers copy it)
    recorded_base: dict | None = None  # hf: the recorded BaseConfig
    extra: dict | None = None  # hf: the source's own meta, kept where ours has no value


def import_heads(
    src: str | Path,
    fmt: Format,
    base: BaseConfig | None,
    out: str | Path,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Read `src` in format `fmt`, check it against `base`, write our heads dir at `out`."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise NotFound(f"{src} is not a directory (src= must be a {fmt} heads dir)")
    _check_out(out, src, overwrite)
    readers = {"hf": _read_hf, "hydra": _read_hydra, "medusa": _read_medusa}
    if fmt not in readers:
        fail("format", fmt, "one of hf, hydra, medusa")
    parsed = readers[fmt](src)
    if base is None:
        if not parsed.recorded_base:
            fail("base", None, f"{src} records no base config: pass base=NAME")
        base = recorded_base(parsed.recorded_base)
    fingerprint, base_config = _base_info(base)
    check_base(
        {
            "hidden_size": parsed.hidden_size,
            "vocab_size": parsed.vocab_size,
            "base": {"name": parsed.base_id},
        },
        fingerprint,
        f"in {src}",
    )
    shape = {
        **(parsed.base_shape or base_shape(base_config)),
        "hidden_size": parsed.hidden_size,
        "vocab_size": parsed.vocab_size,
    }
    placeholder = torch.empty(parsed.vocab_size, parsed.hidden_size)
    heads = build_heads(parsed.head, shape, placeholder, parsed.state.get("draft.to_full"))
    try:
        heads.load_state_dict(parsed.state, strict=True)
    except RuntimeError as e:
        raise FormatError(f"{src}: its weights do not fit {parsed.head.name} heads: {e}") from None
    meta = heads_meta(
        heads,
        fingerprint,
        base.to_dict(),
        imported={"format": fmt, "src": str(src.resolve()), "base": parsed.base_id},
    )
    for key, value in (parsed.extra or {}).items():  # hf: keep what training recorded
        if key not in meta or (meta[key] is None and key == "default_tree"):
            meta[key] = value
    save_heads(out, heads.eval(), meta)
    return {
        "out": str(out),
        "arch": heads.arch,
        "num_heads": heads.num_heads,
        "num_layers": heads.cfg.num_layers,
        "draft_vocab_size": heads.draft.size if heads.draft is not None else None,
        "hidden_state_offset": heads.cfg.hidden_state_offset,
        "base": fingerprint.get("name"),
    }


def _base_info(cfg: BaseConfig) -> tuple[dict, Any]:
    """Fingerprint and transformers config of the base, without loading big weights."""
    from train.core.base import DeferredBase, load_base

    # A deferred base answers from a meta-device skeleton; the tiny test base is built whole.
    b = load_base(cfg) if cfg.source == "tiny_random" else DeferredBase(cfg)
    return b.fingerprint(), b.config


class _Take:
    """Pops tensors from a source state dict; names what is missing and what is left over."""

    def __init__(self, state: dict[str, torch.Tensor], where: Path):
        self.state, self.where = dict(state), where

    def __call__(self, key: str, optional: bool = False) -> torch.Tensor | None:
        if key in self.state:
            return self.state.pop(key)
        if optional:
            return None
        raise FormatError(f"{self.where} has no tensor {key!r}; is this the right format=?")

    def done(self, ignore: tuple[str, ...] = ()) -> None:
        left = sorted(k for k in self.state if k not in ignore)
        if left:
            more = f" and {len(left) - 5} more" if len(left) > 5 else ""
            raise FormatError(
                f"{self.where} has tensors these heads have no place for: "
                f"{', '.join(left[:5])}{more}; is this the right format=?"
            )


def _load_torch(path: Path) -> dict[str, torch.Tensor]:
    try:  # weights_only: a checkpoint from elsewhere must not run code when read
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means "not a plain state dict"
        raise FormatError(f"{path} is not a plain state dict of tensors ({e})") from None
    if not isinstance(state, dict):
        raise FormatError(f"{path} holds a {type(state).__name__}, expected a state dict")
    return state


def _int(cfg: dict, key: str, default: int | None, where: Path) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{where}: {key} = {value!r}, expected an integer")
    return value


def _read_hydra(src: Path) -> _Parsed:
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
    take = _Take(_load_torch(src / HYDRA_WEIGHTS), src / HYDRA_WEIGHTS)
    ours: dict[str, torch.Tensor] = {}
    biases: dict[str, torch.Tensor | None] = {}
    for k in range(k_heads):
        for j in range(n_layers):
            for p in ("weight", "bias"):
                ours[f"mlps.{k}.{j}.linear.{p}"] = take(f"hydra_mlp.{k}.{j}.linear.{p}")
        if grounded:
            ours[f"mlps.{k}.0.proj.weight"] = take(f"hydra_mlp.{k}.0.res_connection.weight")
            biases[f"mlps.{k}.0.proj.bias"] = take(
                f"hydra_mlp.{k}.0.res_connection.bias", optional=True
            )
        ours[f"lm_heads.{k}.weight"] = take(f"hydra_lm_head.{k}.weight")
        biases[f"lm_heads.{k}.bias"] = take(f"hydra_lm_head.{k}.bias", optional=True)
    take.done(ignore=("input_embed_fn.weight",))  # the base's own embedding table
    # Their nn.Linear layers keep (and train) a bias: heads with any non-zero one are imported
    # with head.bias=true, all others as our plain heads.
    has_bias = any(b is not None and torch.count_nonzero(b) for b in biases.values())
    if has_bias:
        for key, b in biases.items():
            ref = ours[key.replace(".bias", ".weight")]
            ours[key] = b if b is not None else ref.new_zeros(ref.shape[0])
    vocab, hidden = ours["lm_heads.0.weight"].shape
    head = from_group(
        HeadConfig,
        "head",
        "hydra" if grounded else "medusa",
        num_heads=k_heads,
        num_layers=n_layers,
        hidden_state_offset=offset,
        bias=bool(has_bias),
    )
    return _Parsed(head, hidden, vocab, ours, str(cfg.get("base_model_name_or_path", "?")))


def _read_medusa(src: Path) -> _Parsed:
    cfg_path = src / "config.json"
    cfg = _read_json(cfg_path)
    base_id = str(cfg.get("base_model_name_or_path", "?"))
    if (src / "model.safetensors").is_file():
        return _read_medusa_vllm(src, cfg, base_id)
    for name in (MEDUSA_TRT_WEIGHTS, "medusa_lm_head.pt"):
        if (src / name).is_file():
            return _read_medusa_fasterdecoding(src / name, cfg, base_id)
    raise NotFound(
        f"{src} has no Medusa weights: expected model.safetensors (vLLM), "
        f"{MEDUSA_TRT_WEIGHTS} or medusa_lm_head.pt (FasterDecoding/Medusa, TensorRT-LLM)"
    )


def _read_medusa_vllm(src: Path, cfg: dict, base_id: str) -> _Parsed:
    from safetensors.torch import load_file

    where = src / "config.json"
    # vLLM's MedusaConfig takes any "num*heads" / "num*layers" key as num_heads / num_layers.
    k_heads = _int(cfg, "num_heads", cfg.get("medusa_num_heads"), where)
    n_layers = _int(cfg, "num_hidden_layers", cfg.get("medusa_num_layers", 1), where)
    vocab = _int(cfg, "vocab_size", None, where)
    truncated = _int(cfg, "truncated_vocab_size", vocab, where)
    raw = load_file(str(src / "model.safetensors"))
    take = _Take({k.removeprefix("medusa_heads."): v for k, v in raw.items()}, src)
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
    for k in range(k_heads):
        for j in range(n_layers):
            w = take(f"blocks.{k}.layers.{j}.weight")
            b = take(f"blocks.{k}.layers.{j}.bias", optional=True)  # medusa_fc_bias=false
            ours[f"mlps.{k}.{j}.linear.weight"] = w
            ours[f"mlps.{k}.{j}.linear.bias"] = (
                torch.zeros(w.shape[0], dtype=w.dtype) if b is None else b
            )
        lm = shared_lm if shared else take(f"lm_heads.{k}.weight")
        if draft is not None and lm.shape[0] > draft.numel():  # full rows: vLLM slices them too
            lm = lm[draft]
        ours[f"lm_heads.{k}.weight"] = lm.clone() if shared else lm
    take.done()
    if draft is not None:
        ours["draft.to_full"] = draft
    hidden = ours["mlps.0.0.linear.weight"].shape[1]
    head = from_group(
        HeadConfig,
        "head",
        "medusa",
        num_heads=k_heads,
        num_layers=n_layers,
        draft_vocab_size=None if draft is None else int(draft.numel()),
    )
    return _Parsed(head, hidden, vocab, ours, base_id)


def _read_medusa_fasterdecoding(path: Path, cfg: dict, base_id: str) -> _Parsed:
    from safetensors.torch import load_file

    where = path.parent / "config.json"
    n_layers = _int(cfg, "medusa_num_layers", cfg.get("num_hidden_layers", 1), where)
    k_heads = _int(cfg, "medusa_num_heads", cfg.get("num_heads"), where)
    state = load_file(str(path)) if path.suffix == ".safetensors" else _load_torch(path)
    take = _Take(state, path)
    ours: dict[str, torch.Tensor] = {}
    for k in range(k_heads):
        for j in range(n_layers):
            for p in ("weight", "bias"):
                ours[f"mlps.{k}.{j}.linear.{p}"] = take(f"{k}.{j}.linear.{p}")
        ours[f"lm_heads.{k}.weight"] = take(f"{k}.{n_layers}.weight")
    take.done()
    vocab, hidden = ours["lm_heads.0.weight"].shape
    head = from_group(HeadConfig, "head", "medusa", num_heads=k_heads, num_layers=n_layers)
    return _Parsed(head, hidden, vocab, ours, base_id)


def _read_hf(src: Path) -> _Parsed:
    from safetensors.torch import load_file

    config = _read_json(src / "config.json")
    meta = {k: v for k, v in config.items() if k not in HF_KEYS}
    if meta.get("format") != FORMAT:
        raise FormatError(
            f"{src / 'config.json'} is not a hydra-heads hf export (format = "
            f"{meta.get('format')!r}, expected {FORMAT!r}); zankner/Hydra heads are "
            "format=hydra, Medusa heads (vLLM, FasterDecoding) format=medusa"
        )
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise NotFound(f"{weights} not found")
    return _Parsed(
        head=recorded_head(meta["head"]),
        hidden_size=int(meta["hidden_size"]),
        vocab_size=int(meta["vocab_size"]),
        state=load_file(str(weights)),
        base_id=str(config.get("base_model_name_or_path") or meta.get("base", {}).get("name")),
        base_shape=meta.get("base_shape"),
        recorded_base=(meta.get("base") or {}).get("config"),
        extra={k: v for k, v in meta.items() if k not in ("imported",)},
    )
