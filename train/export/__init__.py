"""Convert heads checkpoints to and from the hf, hydra (zankner/Hydra), medusa (vLLM), eagle3
(SafeAILab/EAGLE: SGLang, vLLM) and speculators (vLLM) layouts.

Every conversion is exact or refused: a format that cannot express what our heads compute (a
bias we lack, weights their code shares, a layer they normalise) is a `FormatError` naming the
option and the fix, never a file that proposes other tokens.

One module per format (`hf`, `hydra`, `medusa`; `eagle3` for both EAGLE-3 layouts) holds its
layout: `files(...)`, what an export writes, and `read(src)`, a source in our parameter names;
`model_card` writes hf's README.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from train.core.base import BaseConfig, DeferredBase, load_base, recorded_base
from train.core.checkpoint import check_base
from train.core.config import fail
from train.core.errors import NotFound
from train.export import eagle3, hf, hydra, medusa, model_card
from train.export.common import FormatError, check_out, write_dir
from train.heads import base_shape, build_heads, heads_meta, load_heads, save_heads
from train.heads.blocks import DraftVocabError

Format = Literal["hf", "hydra", "medusa", "eagle3", "speculators"]
FORMATS = "hf, hydra, medusa, eagle3, speculators"


def recorded_base_id(meta: dict) -> str:
    """The base's hub id when it was loaded from the hub, else its config name."""
    base = meta.get("base") or {}
    cfg = base.get("config") or {}
    if cfg.get("source") == "pretrained" and cfg.get("path"):
        return str(cfg["path"])
    return str(base.get("name") or cfg.get("name") or "unknown")


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
    check_out(out, heads_dir, overwrite)
    base_id = base_model or recorded_base_id(meta)
    notes: list[str] = []
    if fmt == "hf":
        res = model_card.eval_result(heads_dir, heads, eval_json, notes)
        files = hf.files(heads_dir, heads, meta, base_id, res)
    elif fmt == "hydra":
        files = hydra.files(heads, base_id)
    elif fmt == "medusa":
        files = medusa.files(heads, base_id, notes)
    elif fmt in ("eagle3", "speculators"):
        files = eagle3.files(heads, base_id, fmt, notes)
    else:
        fail("format", fmt, f"one of {FORMATS}")
    written = write_dir(out, files)
    return {"format": fmt, "out": str(out), "arch": heads.arch, "files": written, "notes": notes}


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
    check_out(out, src, overwrite)
    readers = {"hf": hf.read, "hydra": hydra.read, "medusa": medusa.read}
    readers |= {"eagle3": eagle3.read, "speculators": eagle3.read}  # it tells them apart
    if fmt not in readers:
        fail("format", fmt, f"one of {FORMATS}")
    parsed = readers[fmt](src)
    if base is None:
        if not parsed.recorded_base:
            fail("base", None, f"{src} records no base config: pass base=NAME")
        base = recorded_base(parsed.recorded_base)
    # A deferred base answers from a meta-device skeleton; the tiny test base is built whole.
    b = load_base(base) if base.source == "tiny_random" else DeferredBase(base)
    fingerprint = b.fingerprint()
    size = {"hidden_size": parsed.hidden_size, "vocab_size": parsed.vocab_size}
    check_base({**size, "base": {"name": parsed.base_id}}, fingerprint, f"in {src}")
    shape = {**(parsed.base_shape or base_shape(b.config)), **size}
    placeholder = torch.empty(parsed.vocab_size, parsed.hidden_size)
    try:
        heads = build_heads(parsed.head, shape, placeholder, parsed.state.get("draft.to_full"))
    except DraftVocabError as e:  # e.g. a d2t map outside the vocab it records
        raise FormatError(f"{src}: {e}") from None
    try:
        heads.load_unique_state(parsed.state)
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
