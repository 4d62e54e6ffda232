"""Self-distillation data: regenerate assistant turns with the base model, resumable by shard."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch

from data_prep.config import RegenConfig
from train.core.atomic import write_json, write_text

log = logging.getLogger(__name__)


def _manifest(rows: list[dict], cfg: RegenConfig, base_name: str, seed: int) -> dict:
    h = hashlib.sha256()
    for r in rows:
        h.update(r["key"].encode())
    return {
        "conversations": len(rows),
        "keys_sha256": h.hexdigest(),
        "base": base_name,
        "seed": seed,
        "regen": cfg.to_dict(),
    }


@torch.no_grad()
def _generate(base, prompts: list[list[int]], cfg: RegenConfig) -> list[str]:
    """Batched generation with left padding; returns the decoded replies."""
    tok = base.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    device = base.model.device
    eos = {tok.eos_token_id}
    gen_eos = base.model.generation_config.eos_token_id
    eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
    eos.discard(None)
    kwargs = {"do_sample": cfg.temperature > 0}
    if cfg.temperature > 0:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = base.model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=sorted(eos),
        pad_token_id=pad,
        use_cache=True,
        **kwargs,
    )
    return [tok.decode(o[width:], skip_special_tokens=True).strip() for o in out.cpu()]


def _regen_shard(rows: list[dict], base, cfg: RegenConfig) -> list[dict]:
    """Regenerate every assistant turn of `rows`, turn by turn, batching across conversations."""
    tok = base.tokenizer
    limit = getattr(base.config, "max_position_embeddings", None)
    convs = []
    for r in rows:
        msgs = [{"role": a, "content": c} for a, c in zip(r["roles"], r["contents"], strict=True)]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if cfg.max_turns is not None:
            turns = turns[: cfg.max_turns]
        convs.append({"row": r, "msgs": msgs, "turns": turns, "done": 0, "stop": None})
    step = 0
    while True:
        active = [c for c in convs if c["stop"] is None and step < len(c["turns"])]
        if not active:
            break
        for b in range(0, len(active), cfg.batch_size):
            group = active[b : b + cfg.batch_size]
            prompts = []
            for c in group:
                idx = c["turns"][step]
                p = tok.apply_chat_template(
                    c["msgs"][:idx], add_generation_prompt=True, tokenize=True, return_dict=False
                )
                if hasattr(p, "keys"):
                    p = p["input_ids"]
                prompts.append(list(p))
            fits = [limit is None or len(p) + cfg.max_new_tokens <= limit for p in prompts]
            if not all(fits):
                for c, ok in zip(group, fits, strict=True):
                    if not ok:
                        c["stop"] = c["turns"][step]  # context full: keep what fits
                group = [c for c, ok in zip(group, fits, strict=True) if ok]
                prompts = [p for p, ok in zip(prompts, fits, strict=True) if ok]
                if not group:
                    continue
            replies = _generate(base, prompts, cfg)
            for c, reply in zip(group, replies, strict=True):
                idx = c["turns"][step]
                if not reply:
                    c["stop"] = idx  # an empty reply ends the conversation before this turn
                    continue
                c["msgs"][idx] = {"role": "assistant", "content": reply}
                c["done"] += 1
        step += 1
    out = []
    for c in convs:
        # Keep the conversation up to its last regenerated reply.
        end = c["turns"][c["done"] - 1] + 1 if c["done"] else 0
        msgs = c["msgs"][:end]
        r = c["row"]
        out.append(
            {
                "conv_id": r["conv_id"],
                "key": r["key"],
                "roles": [m["role"] for m in msgs],
                "contents": [m["content"] for m in msgs],
                "regenerated_turns": c["done"],
            }
        )
    return out


def regenerate(
    rows: list[dict], base, cfg: RegenConfig, workdir: Path, seed: int = 0, skips=None
) -> list[dict]:
    """Replace assistant turns in `rows` by the base model's own replies.

    Work is cut into shards of `cfg.shard_size` conversations; each finished shard is written
    atomically to `workdir`, so a killed job resumes at the first missing shard. Conversations
    whose first reply comes back empty are dropped (counted as 'regen_empty_reply').
    """
    from tqdm.auto import tqdm

    workdir.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(rows, cfg, base.cfg.name, seed)
    mpath = workdir / "manifest.json"
    if mpath.exists() and json.loads(mpath.read_text()) != manifest:
        log.warning("regeneration inputs changed since the last run; discarding %s", workdir)
        shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
    write_json(mpath, manifest)
    n_shards = (len(rows) + cfg.shard_size - 1) // cfg.shard_size
    done = sum((workdir / f"shard-{s:05d}.jsonl").exists() for s in range(n_shards))
    if done:
        log.info("resuming regeneration: %d of %d shards already done", done, n_shards)
    result: list[dict] = []
    for s in tqdm(range(n_shards), desc="regenerating", unit=" shard"):
        path = workdir / f"shard-{s:05d}.jsonl"
        if not path.exists():
            torch.manual_seed(seed * 1_000_003 + s)  # per-shard seed: resume == uninterrupted
            shard = _regen_shard(rows[s * cfg.shard_size : (s + 1) * cfg.shard_size], base, cfg)
            write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in shard))
        with open(path, encoding="utf-8") as f:
            result.extend(json.loads(line) for line in f)
    kept = []
    for r in result:
        if r.get("regenerated_turns", 0) == 0:
            if skips is not None:
                skips.skip("regen_empty_reply", f"conversation {r['conv_id']}")
            continue
        r.pop("regenerated_turns", None)
        kept.append(r)
    return kept
