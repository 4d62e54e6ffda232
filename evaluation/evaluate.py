"""`hydra-heads eval`: speculative vs plain decoding of trained heads on a prompt set -> eval.json.

setup (base from the heads' config, heads, prompts, tree) -> decode every prompt both ways in the
same run -> acceptance figures, speedup, lossless check -> <out>/eval.json (+ tree.json).
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from data_prep.readers import SkipLog
from evaluation.calibrate import Calibration, calibrate, choose_tree
from evaluation.config import EvalConfig, TreeConfig
from evaluation.decode import Decoder, Generation, SamplingConfig, eos_ids
from evaluation.prompts import (
    PromptItem,
    held_out_prompts,
    jsonl_prompts,
    prepared_rows,
)
from evaluation.tree import PRESETS, Tree, branching, chain, grow
from train.core.atomic import write_json, write_text
from train.core.base import BaseConfig, load_base, recorded_base
from train.core.checkpoint import read_meta
from train.core.errors import ConfigError, UserError
from train.heads import load_heads

log = logging.getLogger(__name__)


class LosslessError(UserError, RuntimeError):
    """Greedy speculative decoding produced other tokens than plain greedy decoding."""


# -- setup -----------------------------------------------------------------------------------
def base_config(cfg: EvalConfig, meta: dict) -> BaseConfig:
    if cfg.base is not None:
        return cfg.base
    recorded = meta.get("base", {}).get("config")
    if not recorded:
        raise ConfigError(
            f"{cfg.heads} does not record its base model; pass base=NAME (e.g. base=smollm2_135m)"
        )
    return recorded_base(recorded)


def fixed_tree(tc: TreeConfig, num_heads: int) -> Tree | None:
    """The tree for the fixed kinds; None for calibrated / auto."""
    if tc.kind == "preset":
        paths = chain(num_heads) if tc.name == "chain" else PRESETS[tc.name]
        return Tree.from_paths(paths, num_heads)
    if tc.kind == "branching":
        return Tree.from_paths(branching(tc.branching), num_heads)
    if tc.kind == "paths":
        return Tree.from_paths(tc.paths, num_heads)
    if tc.kind == "file":
        return Tree.load(tc.path, num_heads)
    return None


def render_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the base tokenizer has no chat template, so chat prompts cannot be rendered; use a "
            "chat model or held-out prepared prompts (eval.prepared=DIR)"
        )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def calibration_rows(ds, start: int, cfg: TreeConfig):
    """Held-out rows after the ones used as prompts, cut to calibration_length tokens."""
    n = min(cfg.calibration_rows, max(len(ds) - start, 0))
    if n == 0:  # too few held-out rows: reuse from the top rather than fail
        start, n = 0, min(cfg.calibration_rows, len(ds))
    for row in ds.select(range(start, start + n)):
        L = cfg.calibration_length
        yield list(row["input_ids"])[:L], list(row["loss_mask"])[:L]


# -- figures ---------------------------------------------------------------------------------
def acceptance_figures(accepted: list[int], depth: int) -> dict[str, Any]:
    """tau, per-depth acceptance (cumulative: P(step reaches depth d); conditional: P(reaches d |
    reached d-1)) and the histogram of draft tokens accepted per step."""
    steps = len(accepted)
    hist = [sum(1 for a in accepted if a == d) for d in range(depth + 1)]
    reach = [sum(1 for a in accepted if a >= d) for d in range(depth + 1)]
    return {
        "steps": steps,
        "tau": (sum(accepted) + steps) / steps if steps else None,
        "accepted_histogram": hist,
        "acceptance_cumulative": [reach[d] / steps if steps else None for d in range(1, depth + 1)],
        "acceptance_conditional": [
            reach[d] / reach[d - 1] if reach[d - 1] else None for d in range(1, depth + 1)
        ],
    }


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# -- the run ---------------------------------------------------------------------------------
def run_eval(cfg: EvalConfig, config_yaml: str | None = None) -> dict[str, Any]:
    ev, tc = cfg.eval, cfg.tree
    if ev.threads:
        torch.set_num_threads(ev.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if config_yaml is not None:
        write_text(out / "config.yaml", config_yaml)
    t_setup = time.perf_counter()
    meta = read_meta(cfg.heads)
    base = load_base(base_config(cfg, meta), ev.device)
    heads, meta = load_heads(cfg.heads, base.fingerprint(), ev.device)
    tree = fixed_tree(tc, heads.num_heads)  # fails on a bad tree before any decoding
    sampling = SamplingConfig(
        ev.temperature, ev.acceptance, ev.seed, ev.posterior_threshold, ev.posterior_alpha
    )
    decoder = Decoder(
        base.model,
        eos_ids(base.tokenizer, base.model),
        heads,
        None,
        sampling,
        int(meta.get("hidden_state_offset") or 0),
    )

    # prompts
    skips = SkipLog()
    prepared = ev.prepared or (meta.get("training") or {}).get("prepared")
    ds, next_row = None, 0
    if ev.prompts:
        items = jsonl_prompts(ev.prompts, ev.num_prompts, skips)
    else:
        if not prepared:
            raise ConfigError(
                "no prompts: pass eval.prompts=FILE.jsonl or eval.prepared=DIR (a prep output)"
            )
        ds = prepared_rows(prepared)
        items, next_row = held_out_prompts(ds, ev.num_prompts, ev.max_prompt_tokens)
        if not items:
            raise ConfigError(
                f"no held-out prompt of <= {ev.max_prompt_tokens} tokens in {prepared}: raise "
                "eval.max_prompt_tokens or pass eval.prompts=FILE.jsonl"
            )

    def item_prompt(item: PromptItem) -> list[int]:
        if item.tokens is not None:
            return item.tokens
        msgs = [{"role": "system", "content": item.system}] if item.system else []
        return render_chat(base.tokenizer, [*msgs, {"role": "user", "content": item.user_turns[0]}])

    # tree
    tree_info: dict[str, Any] = {"kind": tc.kind}
    calib: Calibration | None = None
    if tree is None:
        if ds is None and prepared:
            ds = prepared_rows(prepared)
        if ds is None:
            raise ConfigError(
                f"tree={tc.kind} measures the heads on held-out prepared rows: pass "
                "eval.prepared=DIR (a prep output) or a fixed tree (tree=mc_sim_7b_63)"
            )
        log.info("calibrating on %d held-out rows", tc.calibration_rows)
        calib = calibrate(
            base.model,
            heads,
            calibration_rows(ds, next_row, tc),
            tc.topk,
            decoder.offset,
        )
        tree_info["calibration"] = calib.to_json()
        if tc.kind == "calibrated":
            tree = Tree.from_paths(grow(calib.acc, tc.budget), heads.num_heads)
        else:
            # Timed on the longest prompt: a speculative step's KV upkeep and tree attention
            # grow with the context faster than a plain step does, so a short prompt would
            # promise a speedup that longer prompts do not deliver.
            longest = max((item_prompt(it) for it in items), key=len)
            best, options = choose_tree(
                decoder, calib, longest, tc.budget, min_speedup=tc.min_speedup
            )
            tree = best.tree
            tree_info["auto"] = [
                {
                    "nodes": o.tree.num_nodes - 1,
                    "expected_tau": round(o.expected_tau, 4),
                    "step_ms": round(o.step_s * 1e3, 2),
                    "expected_speedup": round(o.expected_speedup, 4),
                }
                for o in options
            ]
        tree_info["expected_tau"] = tree.expected_length(calib.acc)
    decoder.set_tree(tree)
    tree.save(out / "tree.json")
    tree_info.update(
        paths=tree.to_json(), num_nodes=tree.num_nodes - 1, depth=tree.max_depth, file="tree.json"
    )
    setup_s = time.perf_counter() - t_setup

    # decode
    decoder.plain(item_prompt(items[0]), 4)  # warm-up: first-call allocations off the clock
    records, mismatches = [], []
    spec_all: list[Generation] = []
    plain_all: list[Generation] = []
    bar = _progress(len(items), ev.progress)
    tok = base.tokenizer
    for idx, item in enumerate(items):
        msgs = [{"role": "system", "content": item.system}] if item.system else []
        for turn in range(item.num_turns):
            if item.tokens is not None:
                prompt = item.tokens
            else:
                msgs.append({"role": "user", "content": item.user_turns[turn]})
                prompt = render_chat(tok, msgs)
            if len(prompt) > ev.max_prompt_tokens:
                skips.skip("prompt_too_long", item.name, f"turn {turn}: {len(prompt)} tokens")
                break
            seed = ev.seed + 1000 * idx + turn
            runs: dict[str, Generation] = {}
            order = ("spec", "plain") if idx % 2 == 0 else ("plain", "spec")  # cancel drift
            for which in order:
                if which == "plain" and not ev.compare_plain:
                    continue
                decoder.reseed(seed)
                fn = decoder.speculative if which == "spec" else decoder.plain
                runs[which] = fn(prompt, ev.max_new_tokens)
            spec, plain = runs["spec"], runs.get("plain")
            spec_all.append(spec)
            rec = {
                "item": item.name,
                "turn": turn,
                "prompt_tokens": len(prompt),
                "prompt": tok.decode(prompt[-400:], skip_special_tokens=False)[-300:],
                "output": tok.decode(spec.tokens, skip_special_tokens=True),
                "new_tokens": len(spec.tokens),
                "finish": spec.finish,
                "steps": spec.steps,
                "tau": round(spec.tau, 4),
                "spec_s": round(spec.total_s, 4),
            }
            if plain is not None:
                plain_all.append(plain)
                rec["plain_s"] = round(plain.total_s, 4)
                rec["plain_new_tokens"] = len(plain.tokens)
                if ev.check_lossless:
                    rec["lossless"] = plain.tokens == spec.tokens
                    if not rec["lossless"]:
                        at = _first_diff(plain.tokens, spec.tokens)
                        mismatches.append({"item": item.name, "turn": turn, "first_diff": at})
            records.append(rec)
            if item.tokens is None:
                msgs.append({"role": "assistant", "content": rec["output"]})
        bar.update(1)
        acc = [a for g in spec_all for a in g.accepted]
        if acc:
            bar.set_postfix(tau=f"{(sum(acc) + len(acc)) / len(acc):.2f}")
    bar.close()

    result = summarize(spec_all, plain_all, tree.max_depth)
    result.update(
        {
            "heads": str(Path(cfg.heads).expanduser().resolve()),
            "arch": heads.arch,
            "num_heads": heads.num_heads,
            "base": base.fingerprint(),
            "tree": tree_info,
            "sampling": asdict(sampling),
            "max_new_tokens": ev.max_new_tokens,
            "prompts": {
                "source": ev.prompts or f"{prepared} (validation, first turns)",
                "items": len(items),
                "generations": len(records),
                "skipped": dict(skips.counts),
            },
            "lossless": (not mismatches) if ev.check_lossless else None,
            "mismatches": mismatches,
            "setup_s": round(setup_s, 2),
            "hardware": {
                "device": ev.device,
                "threads": torch.get_num_threads(),
                "cpu": platform.processor() or platform.machine(),
                "torch": torch.__version__,
            },
            "records": records,
        }
    )
    write_json(out / "eval.json", result)
    if mismatches:
        raise LosslessError(
            f"greedy speculative decoding differs from plain greedy decoding on "
            f"{len(mismatches)} of {len(records)} prompts (first: {mismatches[0]}); see "
            f"{out / 'eval.json'}"
        )
    return result


def summarize(spec: list[Generation], plain: list[Generation], depth: int) -> dict[str, Any]:
    accepted = [a for g in spec for a in g.accepted]
    fig = acceptance_figures(accepted, depth)
    spec_tokens = sum(len(g.tokens) for g in spec)
    spec_s = sum(g.total_s for g in spec)
    steps = max(fig["steps"], 1)
    res: dict[str, Any] = {
        **fig,
        "new_tokens": spec_tokens,
        "spec_s": round(spec_s, 4),
        "spec_tokens_per_s": spec_tokens / spec_s if spec_s else None,
        "time_per_step_ms": {
            "propose": 1e3 * sum(g.propose_s for g in spec) / steps,
            "verify": 1e3 * sum(g.verify_s for g in spec) / steps,
            "bookkeeping": 1e3 * sum(g.bookkeeping_s for g in spec) / steps,
        },
    }
    if plain:
        plain_tokens = sum(len(g.tokens) for g in plain)
        plain_s = sum(g.total_s for g in plain)
        pt = plain_tokens / plain_s
        res.update(
            plain_new_tokens=plain_tokens,
            plain_s=round(plain_s, 4),
            plain_tokens_per_s=pt,
            plain_step_ms=1e3
            * sum(g.total_s - g.prefill_s for g in plain)
            / max(sum(g.steps for g in plain), 1),
            speedup=res["spec_tokens_per_s"] / pt if pt else None,
        )
    return res


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval prompts", unit="prompt", disable=not enabled)


__all__ = ["LosslessError", "run_eval"]
