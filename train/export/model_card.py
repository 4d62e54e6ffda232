"""The model card (README.md) of an hf export, and finding the eval.json whose figures it shows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from train.core.config import fail
from train.export.common import read_json
from train.heads import HeadSet

ARCH_TITLE = {
    "medusa": "Medusa",
    "hydra": "Hydra",
    "hydra_pp": "Hydra++",
    "hydra_eagle": "Hydra eagle-attn",
    "hydra_cross_attn": "Hydra cross-attn",
    "eagle3": "EAGLE-3",
}


def eval_result(
    heads_dir: Path, heads: HeadSet, eval_json: str | Path | None, notes: list[str]
) -> dict | None:
    """The eval.json for the model card: the one given, else one beside the heads for them."""
    if eval_json is not None:
        res = read_json(Path(eval_json))
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
        res = read_json(p)
        # Only an eval of these very heads: a sibling run's eval.json must not end up here.
        if res.get("heads") and Path(str(res["heads"])).resolve() == heads_dir.resolve():
            notes.append(f"model card figures from {p} (found)")
            return res
    notes.append("no eval.json given or found: the model card has no figures (pass eval=FILE)")
    return None


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ci(res: dict, key: str) -> str:
    """ " (95% CI a-b)" from eval.json's `<key>_ci95`, or nothing (older files, one item)."""
    ci = res.get(f"{key}_ci95")
    return f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""


def _features(heads: HeadSet, offset: int) -> str:
    if isinstance(heads.features, tuple):  # EAGLE-3's fused layers
        return "the inputs of layers " + ", ".join(str(i) for i in heads.features)
    return "last (post-norm)" if offset == 0 else f"layer {offset} from last"


# Over 80 lines: the card is one template of text, read top to bottom as it renders.
def model_card(heads: HeadSet, meta: dict, base_id: str, res: dict | None) -> str:
    """README.md of an hf export: what the heads are, how to use them, how well they did."""
    title = ARCH_TITLE[heads.arch]
    desc = {
        "medusa": "K independent residual MLPs on the base model's hidden state (Cai et al., 2024)",
        "hydra": "sequentially dependent heads: head k also reads the embeddings of the tokens "
        "before its target (Ankner et al., 2024)",
        "hydra_pp": "Hydra heads over one extra causal self-attention decoder layer, "
        "distilled from the base model (Ankner et al., 2024)",
        "hydra_eagle": "one EAGLE-style decoder layer over the next token's embedding and the "
        "base hidden state, drafting recurrently on its own states (zankner/Hydra eagle-attn)",
        "hydra_cross_attn": "the next token's embedding attending to the base hidden states, "
        "drafting recurrently with its ancestors' outputs as keys (zankner/Hydra cross-attn)",
        "eagle3": "low, middle and high base layers fused, one decoder layer over the next "
        "token's embedding and that feature, trained by training-time test (Li et al., 2025)",
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
        ("training-time test steps", str(heads.num_heads))  # EAGLE-3's unrolled steps
        if heads.unrolled
        else ("heads x residual blocks", f"{heads.num_heads} x {heads.cfg.num_layers}"),
        ("hidden size / vocab", f"{heads.hidden_size} / {heads.vocab_size}"),
        ("draft vocab", f"{draft} most frequent training tokens" if draft else "full vocab"),
        ("base hidden state", _features(heads, offset)),
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
            f"| tau (tokens per base forward) | {_num(res.get('tau'), '.3f')}{_ci(res, 'tau')} |",
            f"| speedup vs plain decoding | {_num(speedup, '.3f')}{'x' if speedup else ''}"
            f"{_ci(res, 'speedup')} |",
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
