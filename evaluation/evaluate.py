"""`hydra-heads eval`: speculative vs plain decoding of trained heads on a prompt set -> eval.json.

setup (base from the heads' config, heads, prompts, tree) -> decode every prompt both ways in the
same run -> acceptance figures, speedup, lossless check -> <out>/eval.json (+ tree.json).
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError as JinjaTemplateError

from evaluation.calibrate import calibrate, choose_tree
from evaluation.config import EvalConfig, EvalSettings, TreeConfig
from evaluation.stats import METHOD, intervals
from evaluation.suites import suite_path, suite_prompts
from train.core.atomic import write_json, write_text
from train.core.base import BaseConfig, FrozenBase, load_base, recorded_base
from train.core.checkpoint import read_meta
from train.core.errors import ConfigError, NotFound, UserError
from train.core.prompts import (
    PromptItem,
    check_prepared_base,
    held_out_prompts,
    jsonl_prompts,
    prepared_rows,
)
from train.core.readers import DataError, SkipLog
from train.decoding.backend import quantize_base, use_gqa_attention, use_weight_layout
from train.decoding.decoder import Decoder
from train.decoding.dynamic import DynamicTree, Shape, by_temperature
from train.decoding.generation import STEP_PARTS, Generation, acceptance_figures
from train.decoding.sampling import SamplingConfig, eos_ids
from train.decoding.tree import Tree, TreeError, branching, grow, preset_paths
from train.heads import load_heads

log = logging.getLogger(__name__)


class LosslessError(UserError, RuntimeError):
    """Greedy speculative decoding produced other tokens than plain greedy decoding."""


# -- setup -----------------------------------------------------------------------------------
def base_config(cfg: EvalConfig, meta: dict) -> BaseConfig:
    """The base to load: cfg.base if given, else the one recorded in the heads' `meta`."""
    if cfg.base is not None:
        return cfg.base
    recorded = (meta.get("base") or {}).get("config")
    if not recorded:
        raise ConfigError(
            f"{cfg.heads} does not record its base model; pass base=NAME (e.g. base=smollm2_135m)"
        )
    return recorded_base(recorded)


def fixed_tree(
    tc: TreeConfig, depth: int, limit: int | None, temperature: float = 0.0
) -> Tree | DynamicTree | None:
    """The tree for the fixed kinds (a DynamicTree rule for tree=dynamic, and for
    tree=temperature the one for `temperature`); None for calibrated / auto. `depth`: how deep
    the heads draft a chain or a dynamic tree; `limit`: the deepest they can (None: any)."""
    if tc.kind in ("dynamic", "temperature"):
        if tc.kind == "dynamic":
            spec = DynamicTree(tc.budget, tc.expand, tc.width, tc.depth)
        else:
            cold, hot = (Shape(**s.model_dump()) for s in (tc.cold, tc.hot))
            for name, s in (("cold", cold), ("hot", hot)):
                if s.depth is not None and limit is not None and s.depth > limit:
                    raise TreeError(
                        f"tree.{name}.depth={s.depth} but the heads propose only {limit} "
                        f"tokens: use tree.{name}.depth <= {limit} or null"
                    )
            spec = by_temperature(temperature, tc.budget, cold, hot, tc.hot_at, depth)
        levels = spec.levels(depth, limit)
        grown = spec.candidates(levels)
        if grown < spec.budget:
            log.warning(
                "tree.budget=%d but a dynamic tree of expand=%d width=%d over %d levels grows "
                "only %d draft nodes, so every step verifies at most those; raise "
                "tree.expand / tree.width (docs/eval.md: budget 63 with 10 and 10)",
                spec.budget,
                spec.expand,
                spec.width,
                levels,
                grown,
            )
        return spec
    if tc.kind == "preset":
        return Tree.from_paths(preset_paths(tc.name, depth), limit)
    if tc.kind == "branching":
        return Tree.from_paths(branching(tc.branching), limit)
    if tc.kind == "paths":
        return Tree.from_paths(tc.paths, limit)
    if tc.kind == "file":
        return Tree.load(tc.path, limit)
    return None


def setup(cfg: EvalConfig) -> tuple[FrozenBase, Decoder, Tree | None, dict]:
    """Load base and heads; returns (base, their decoder with no tree yet, fixed_tree(cfg.tree),
    the heads' meta). A bad fixed tree fails here, before any decoding."""
    ev = cfg.eval
    meta = read_meta(cfg.heads)
    base = load_base(base_config(cfg, meta), ev.device)
    heads, meta = load_heads(cfg.heads, base.fingerprint(), ev.device)
    meta["base_fingerprint"] = base.fingerprint()  # of the unquantized weights
    base.model = quantize_base(base.model, ev.base_quant)
    use_gqa_attention(base.model)
    use_gqa_attention(heads)
    tree = fixed_tree(cfg.tree, heads.draft_depth, heads.depth_limit, ev.temperature)
    sampling = SamplingConfig(
        ev.temperature, ev.acceptance, ev.seed, ev.posterior_threshold, ev.posterior_alpha
    )
    offset = int(meta.get("hidden_state_offset") or 0)
    eos = eos_ids(base.tokenizer, base.model)
    decoder = Decoder(base.model, eos, heads, None, sampling, offset, ev.compile)
    # the heads as the decoder runs them (a bf16 copy on a bf16 base: left as they are); a
    # compiled graph prepacks its own frozen weights
    layout = "standard" if ev.compile else ev.weight_layout
    meta["packed_rows"] = use_weight_layout(decoder.model, decoder.heads, layout=layout)
    return base, decoder, tree, meta


# -- prompts ---------------------------------------------------------------------------------
def render_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt tokens of the chat `messages`, ending with the assistant's header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the base tokenizer has no chat template, so chat prompts cannot be rendered; use a "
            "chat model or held-out prepared prompts (eval.prepared=DIR)"
        )
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except JinjaTemplateError as e:  # the template's raise_exception, e.g. Gemma on a system turn
        roles = ", ".join(m["role"] for m in messages)
        raise ConfigError(
            f"the base's chat template refuses an eval prompt with the turns [{roles}]: {e}; "
            "drop what it refuses from the prompts (for example their system prompt) or evaluate "
            "held-out prepared prompts (eval.suite=heldout)"
        ) from e
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _first_prompt(tokenizer, item: PromptItem) -> list[int]:
    if item.tokens is not None:
        return item.tokens
    msgs = [{"role": "system", "content": item.system}] if item.system else []
    return render_chat(tokenizer, [*msgs, {"role": "user", "content": item.user_turns[0]}])


def calibration_split(prepared: str | None, kind: str):
    """The held-out rows of prep output `prepared` for tree=`kind`; else an error saying why."""
    why = "the heads name no prep output"
    if prepared:
        why = f"{prepared} has none" if Path(prepared).exists() else f"{prepared} does not exist"
        with suppress(NotFound, DataError):
            return prepared_rows(prepared)
    raise ConfigError(
        f"tree={kind} measures the heads on held-out (validation) rows of a prep output, and "
        f"{why}: pass "
        "eval.prepared=DIR (a prep output made with data.val_fraction > 0) or choose a fixed "
        "tree (tree=mc_sim_7b_63, tree=chain)"
    )


def load_prompts(
    cfg: EvalConfig, prepared: str | None, calibrating: bool, skips: SkipLog
) -> tuple[list[PromptItem], Iterator | None]:
    """The prompts of eval.suite (a named suite; eval.prompts for `file`, bad rows counted in
    `skips`; held-out first turns of `prepared` for `heldout`) and, if `calibrating`,
    calibration_rows from the held-out rows after the ones used as prompts."""
    ev = cfg.eval
    items = None
    if ev.suite == "file":
        items = jsonl_prompts(ev.prompts, ev.num_prompts, skips)
    elif ev.suite != "heldout":
        items, _ = suite_prompts(ev.suite, ev.num_prompts, ev.seed)
    ds, next_row = None, 0
    if calibrating:
        ds = calibration_split(prepared, cfg.tree.kind)
    elif items is None:
        if not prepared:
            raise ConfigError(
                "no prompts: eval.suite=heldout needs eval.prepared=DIR (a prep output); or pass "
                "eval.suite=mt_bench, eval.suite=humaneval or eval.prompts=FILE.jsonl"
            )
        ds = prepared_rows(prepared)
    if items is None:
        items, next_row = held_out_prompts(ds, ev.num_prompts, ev.max_prompt_tokens)
        if not items:
            raise ConfigError(
                f"no held-out prompt of <= {ev.max_prompt_tokens} tokens in {prepared}: raise "
                "eval.max_prompt_tokens or pass eval.prompts=FILE.jsonl"
            )
    return items, calibration_rows(ds, next_row, cfg.tree) if calibrating else None


# -- tree ------------------------------------------------------------------------------------
def calibration_rows(ds, start: int, cfg: TreeConfig):
    """Held-out rows after the ones used as prompts, cut to calibration_length tokens."""
    n = min(cfg.calibration_rows, max(len(ds) - start, 0))
    if n == 0:  # too few held-out rows: reuse from the top rather than fail
        start, n = 0, min(cfg.calibration_rows, len(ds))
    for row in ds.select(range(start, start + n)):
        L = cfg.calibration_length
        yield list(row["input_ids"])[:L], list(row["loss_mask"])[:L]


def calibrated_tree(
    tc: TreeConfig,
    decoder: Decoder,
    rows: Iterator,
    items: list[PromptItem],
    tokenizer,
    batch: int = 1,
) -> tuple[Tree, dict[str, Any]]:
    """Measure the heads on held-out `rows`, then grow a tree (tree=calibrated) or pick one by
    timing candidates on the longest of `items` (tree=auto). Returns it and its eval.json info."""
    log.info("calibrating on %d held-out rows", tc.calibration_rows)
    t0 = time.perf_counter()
    calib = calibrate(decoder.model, decoder.heads, rows, tc.topk, decoder.offset)
    info: dict[str, Any] = {"kind": tc.kind, "calibration": calib.to_json()}
    info["calibrate_s"] = round(time.perf_counter() - t0, 2)
    if tc.kind == "calibrated":
        tree = Tree.from_paths(grow(calib.acc, tc.budget), decoder.heads.depth_limit)
    else:
        # Timed on the longest prompt: a speculative step's KV upkeep and tree attention
        # grow with the context faster than a plain step does, so a short prompt would
        # promise a speedup that longer prompts do not deliver.
        longest = max((_first_prompt(tokenizer, it) for it in items), key=len)
        t1 = time.perf_counter()
        best, options = choose_tree(
            decoder, calib, longest, tc.budget, min_speedup=tc.min_speedup, batch=batch
        )
        info["choose_s"] = round(time.perf_counter() - t1, 2)
        tree = best.tree
        info["auto"] = [
            {
                "nodes": o.tree.num_nodes - 1,
                "expected_tau": round(o.expected_tau, 4),
                "step_ms": round(o.step_s * 1e3, 2),
                "expected_speedup": round(o.expected_speedup, 4),
                "break_even_tau": round(o.step_s / options[0].step_s, 4),
            }
            for o in options
        ]
    info["expected_tau"] = tree.expected_length(calib.acc)
    return tree, info


def use_tree(decoder: Decoder, tree: Tree | DynamicTree) -> dict[str, Any]:
    """Set `tree` on `decoder`; returns its eval.json fields (run_eval saves a static tree as
    tree.json beside eval.json)."""
    decoder.set_tree(tree)
    if isinstance(tree, DynamicTree):  # no one tree to save: each step grows its own
        depth = tree.levels(decoder.heads.draft_depth, decoder.heads.depth_limit)
        return dict(asdict(tree), num_nodes=tree.budget, depth=depth)
    return dict(
        paths=tree.to_json(), num_nodes=tree.num_nodes - 1, depth=tree.max_depth, file="tree.json"
    )


# -- decode ----------------------------------------------------------------------------------
def decode_prompts(
    decoder: Decoder, items: list[PromptItem], tokenizer, ev: EvalSettings, skips: SkipLog
) -> tuple[list[dict], list[Generation], list[Generation], list[dict]]:
    """Decode every turn of `items` speculatively (and plainly if eval.compare_plain), one
    prompt at a time or eval.batch_size at once. Returns (eval.json records, speculative and
    plain generations, lossless mismatches)."""
    decoder.plain([_first_prompt(tokenizer, items[0])], 4)  # warm-up: first calls allocate
    records, spec_all, plain_all, mismatches = [], [], [], []
    bar = _progress(len(items), ev.progress)
    B = ev.batch_size
    for first in range(0, len(items), B):
        group = items[first : first + B]
        for rec, spec, plain in _decode_batch(decoder, first, group, tokenizer, ev, skips):
            records.append(rec)
            spec_all.append(spec)
            if plain is not None:
                plain_all.append(plain)
            if rec.get("lossless") is False:
                at = _first_diff(plain.tokens, spec.tokens)
                mismatches.append({"item": rec["item"], "turn": rec["turn"], "first_diff": at})
        bar.update(len(group))
        acc = [a for g in spec_all for a in g.accepted]
        if acc:
            bar.set_postfix(tau=f"{(sum(acc) + len(acc)) / len(acc):.2f}")
    bar.close()
    return records, spec_all, plain_all, mismatches


def _turn_prompt(item: PromptItem, turn: int, msgs: list[dict], tok) -> list[int]:
    """Turn `turn`'s prompt: the item's tokens, or the chat so far plus its next user turn."""
    if item.tokens is not None:
        return item.tokens
    msgs.append({"role": "user", "content": item.user_turns[turn]})
    return render_chat(tok, msgs)


def _system(item: PromptItem) -> list[dict]:
    return [{"role": "system", "content": item.system}] if item.system else []


def _decode_batch(decoder: Decoder, first: int, items: list[PromptItem], tok, ev, skips):
    """(record, speculative, plain or None) per turn of eval.batch_size `items` decoded at
    once, turn by turn: a chat gets each reply before its next user turn, and every item's turn
    t is one batch (its reply is in the chat before turn t + 1 is rendered). Records carry the
    batch's number and size; their times are each row's share of the batch's."""
    chats = [_system(item) for item in items]
    alive = list(range(len(items)))
    batch_no = first // ev.batch_size
    for turn in range(max(item.num_turns for item in items)):
        rows, prompts = [], []
        for j in alive:
            if turn >= items[j].num_turns:
                continue
            prompt = _turn_prompt(items[j], turn, chats[j], tok)
            if len(prompt) > ev.max_prompt_tokens:
                skips.skip("prompt_too_long", items[j].name, f"turn {turn}: {len(prompt)} tokens")
                continue
            rows.append(j)
            prompts.append(prompt)
        if not rows:
            return
        runs: dict[str, list[Generation]] = {}
        order = ("spec", "plain") if batch_no % 2 == 0 else ("plain", "spec")  # cancel drift
        for which in order:
            if which == "plain" and not ev.compare_plain:
                continue
            decoder.reseed(ev.seed + 1000 * first + turn)
            fn = decoder.speculative if which == "spec" else decoder.plain
            runs[which] = fn(prompts, ev.max_new_tokens)
        for k, j in enumerate(rows):
            spec = runs["spec"][k]
            plain = runs["plain"][k] if "plain" in runs else None
            rec = _record(items[j], turn, prompts[k], spec, plain, tok, ev)
            rec.update(batch=batch_no, batch_rows=len(rows))
            yield rec, spec, plain
            if items[j].tokens is None:
                chats[j].append({"role": "assistant", "content": rec["output"]})
        alive = rows


def _record(item, turn, prompt, spec: Generation, plain: Generation | None, tok, ev):
    rec = {
        "item": item.name,
        "category": item.category,
        "turn": turn,
        "prompt_tokens": len(prompt),
        "prompt": tok.decode(prompt[-400:], skip_special_tokens=False)[-300:],
        "output": tok.decode(spec.tokens, skip_special_tokens=True),
        "new_tokens": len(spec.tokens),
        "finish": spec.finish,
        "steps": spec.steps,
        "accepted": sum(spec.accepted),  # draft tokens accepted over the steps
        "tau": round(spec.tau, 4),
        "spec_s": round(spec.total_s, 4),
    }
    if plain is not None:
        rec.update(plain_s=round(plain.total_s, 4), plain_new_tokens=len(plain.tokens))
        if ev.acceptance == "greedy":
            rec["identical"] = plain.tokens == spec.tokens
            if not rec["identical"]:
                rec["first_diff"] = _first_diff(plain.tokens, spec.tokens)
        if ev.check_lossless:
            rec["lossless"] = rec["identical"]
    return rec


# -- figures ---------------------------------------------------------------------------------
def _share(records: list[dict], key: str) -> float | None:
    flags = [r[key] for r in records if key in r]
    return sum(flags) / len(flags) if flags else None


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# -- the run ---------------------------------------------------------------------------------
def run_eval(cfg: EvalConfig, config_yaml: str | None = None) -> dict[str, Any]:
    """Decode cfg's prompts with the heads' tree and plainly; write <out>/eval.json (returned),
    tree.json and config.yaml (`config_yaml`, the resolved config), together at the end. Bad input
    fails before any decoding; a greedy output unlike plain greedy decoding raises LosslessError
    at the end."""
    ev = cfg.eval
    if ev.threads:
        torch.set_num_threads(ev.threads)
    out = Path(cfg.out)
    if (out / "eval.json").exists() and not cfg.overwrite:  # minutes to hours of decoding
        raise ConfigError(
            f"out={out} already holds an eval ({out / 'eval.json'}): set overwrite=true to "
            "replace it, or pick another out"
        )
    out.mkdir(parents=True, exist_ok=True)
    t_setup = time.perf_counter()
    base, decoder, tree, meta = setup(cfg)
    load_s = time.perf_counter() - t_setup  # base, heads, weight layout
    prepared = ev.prepared or (meta.get("training") or {}).get("prepared")
    if prepared:  # its held-out rows calibrate tree=auto and give eval.suite=heldout's prompts
        check_prepared_base(prepared, base.tokenizer, "eval.prepared")
    skips = SkipLog()
    items, rows = load_prompts(cfg, prepared, tree is None, skips)
    tree_info: dict[str, Any] = {"kind": cfg.tree.kind}
    if tree is None:
        tree, tree_info = calibrated_tree(
            cfg.tree, decoder, rows, items, base.tokenizer, ev.batch_size
        )
    tree_info.update(use_tree(decoder, tree))
    calibrate_s, choose_s = tree_info.pop("calibrate_s", 0.0), tree_info.pop("choose_s", 0.0)
    setup_s = time.perf_counter() - t_setup
    records, spec, plain, mismatches = decode_prompts(decoder, items, base.tokenizer, ev, skips)
    if not records:  # every prompt over the limit: nothing measured is not a result
        raise ConfigError(
            f"no eval prompt fits eval.max_prompt_tokens={ev.max_prompt_tokens} (skipped: "
            f"{dict(skips.counts)}): raise it (within the base's context), or give shorter prompts"
        )
    result = {
        **summarize(spec, plain, tree_info["depth"]),
        **intervals(records),
        "intervals": {"method": METHOD, "items": len({r["item"] for r in records})},
        "by_category": category_figures(records, spec, plain, tree_info["depth"]),
        "heads": str(Path(cfg.heads).expanduser().resolve()),
        "arch": decoder.heads.arch,
        "num_heads": decoder.heads.num_heads,
        "base": meta["base_fingerprint"],
        "backend": {
            "base_quant": ev.base_quant,
            "weight_layout": ev.weight_layout,
            # per float32 weight shape, the row counts that take its oneDNN-packed copy
            "packed_rows": meta["packed_rows"],
            "compile": ev.compile,
            "batch_size": ev.batch_size,
            "compile_s": round(decoder.compile_s, 2),  # not in any decode time
            "compiled_shapes": sorted(decoder.compiled_shapes),
        },
        "tree": tree_info,
        "sampling": asdict(decoder.sampling),
        "max_new_tokens": ev.max_new_tokens,
        "prompts": {
            "suite": ev.suite,
            "source": prompt_source(ev, prepared),
            "items": len(items),
            "generations": len(records),
            "skipped": dict(skips.counts),
        },
        "lossless": (not mismatches) if ev.check_lossless else None,
        # greedy: the share of generations token-for-token equal to plain decoding's
        "identical_to_plain": _share(records, "identical"),
        "mismatches": mismatches,
        "setup_s": round(setup_s, 2),
        # where setup went: loading (base, heads, the weight layout's probe), the tree's
        # calibration and tree=auto's timing of its candidates
        "setup": {
            "load_s": round(load_s, 2),
            "calibrate_s": calibrate_s,
            "choose_tree_s": choose_s,
        },
        "hardware": {
            "device": ev.device,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "records": records,
    }
    # config.yaml and tree.json go beside the eval.json they produced, all at the end: an eval
    # that fails leaves an earlier result in `out` whole, never paired with another's config
    if config_yaml is not None:
        write_text(out / "config.yaml", config_yaml)
    if isinstance(tree, Tree):
        tree.save(out / "tree.json")
    else:  # a dynamic tree has none: an earlier static eval's would mislead
        (out / "tree.json").unlink(missing_ok=True)
    write_json(out / "eval.json", result)
    if mismatches:
        raise LosslessError(
            f"greedy speculative decoding differs from plain greedy decoding on "
            f"{len(mismatches)} of {len(records)} prompts (first: {mismatches[0]}); see "
            f"{out / 'eval.json'}"
        )
    return result


def summarize(spec: list[Generation], plain: list[Generation], depth: int) -> dict[str, Any]:
    """eval.json's figures over the generations: acceptance_figures, tokens/s, speedup."""
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
            k: 1e3 * sum(getattr(g, f"{k}_s") for g in spec) / steps for k in STEP_PARTS
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
        if fig["steps"]:  # speculation pays when tau beats a step's cost in plain steps
            spec_step = sum(g.total_s - g.prefill_s for g in spec) / fig["steps"]
            res["break_even_tau"] = 1e3 * spec_step / res["plain_step_ms"]
    return res


def category_figures(
    records: list[dict], spec: list[Generation], plain: list[Generation], depth: int
) -> dict[str, dict[str, Any]]:
    """eval.json's `by_category`: per category of `records` (aligned with `spec`, and with
    `plain` unless it is empty), in order of first appearance: generations, tau, cumulative
    acceptance per depth, spec / plain tokens/s and speedup (None without plain decoding)."""
    groups: dict[str, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault(rec["category"], []).append(i)
    figures = {}
    for category, idx in groups.items():
        fig = summarize([spec[i] for i in idx], [plain[i] for i in idx] if plain else [], depth)
        figures[category] = {
            "generations": len(idx),
            "tau": fig["tau"],
            "acceptance_cumulative": fig["acceptance_cumulative"],
            "spec_tokens_per_s": fig["spec_tokens_per_s"],
            "plain_tokens_per_s": fig.get("plain_tokens_per_s"),
            "speedup": fig.get("speedup"),
            "items": len({records[i]["item"] for i in idx}),
            **intervals([records[i] for i in idx]),
        }
    return figures


def prompt_source(ev: EvalSettings, prepared: str | None) -> str:
    """Where eval.suite's prompts came from, for eval.json: a file, or the prep output."""
    if ev.suite == "file":
        return str(ev.prompts)
    if ev.suite == "heldout":
        return f"{prepared} (validation, first turns)"
    return str(suite_path(ev.suite))


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="eval prompts", unit="prompt", disable=not enabled)


__all__ = ["LosslessError", "run_eval"]
