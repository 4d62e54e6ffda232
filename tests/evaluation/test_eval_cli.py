"""`hydra-heads eval` end to end on the tiny model: eval.json figures, trees, prompts, errors.

The first eval runs the real `hydra-heads` process; the others run the same command line in
this process (`run_here`: same parsing, exit status and output, no new interpreter's imports).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import make_heads, pattern_rows, prep_config, run, run_here


def _save_heads(root: Path, base, prepared: Path) -> Path:
    """Hydra++ heads for tiny_random trained (in name) on `prepared`, saved as train saves them."""
    from train.heads import heads_meta, save_heads

    heads = make_heads(base.model, "hydra_pp", 0, 0.01)
    meta = heads_meta(heads, base.fingerprint(), base.cfg.to_dict())
    meta["training"] = {"steps": 0, "prepared": str(prepared)}
    return save_heads(root / "heads", heads, meta)


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory, tiny_prepared, tiny_base) -> Path:
    """Hydra++ heads for tiny_random, saved as `hydra-heads train` saves them."""
    return _save_heads(tmp_path_factory.mktemp("heads"), tiny_base, tiny_prepared)


@pytest.fixture(scope="module")
def trained_heads(tmp_path_factory, tiny_prepared) -> Path:
    """Hydra++ heads that `hydra-heads train` fitted to the counting data (60 steps): unlike
    fresh heads, which all echo the base's next token, head 1 already predicts the token after
    it, so a calibrated tree has a root to grow from."""
    out = tmp_path_factory.mktemp("trained") / "run"
    r = run_here(
        "train",
        "base=tiny_random",
        "head=hydra_pp",
        f"data.prepared={tiny_prepared}",
        f"out={out}",
        "trainer.max_steps=60",
        "trainer.val_check_interval=1000",
        "final_validation=false",
        "data.batch_size=4",
        "optim.lr=3e-3",
        "logger=csv",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "heads"


def _eval(heads: Path, out: Path, *args: str, cli=run_here):
    """`hydra-heads eval` that must succeed: (the process, its eval.json)."""
    r = cli("eval", f"heads={heads}", f"out={out}", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads((out / "eval.json").read_text())


def test_eval_calibrated_tree_writes_figures_and_is_lossless(trained_heads, tmp_path):
    out = tmp_path / "eval"
    r, res = _eval(
        trained_heads,
        out,
        "tree=calibrated",
        "tree.budget=12",
        "tree.calibration_rows=6",
        "eval.num_prompts=3",
        "eval.max_new_tokens=24",
        cli=run,  # the real process, once
    )
    assert res["lossless"] is True and res["mismatches"] == []
    assert res["prompts"]["items"] == 3 and len(res["records"]) == 3
    assert res["tau"] >= 1.0 and res["steps"] == sum(res["accepted_histogram"])
    depth = res["tree"]["depth"]
    assert len(res["acceptance_cumulative"]) == depth == len(res["accepted_histogram"]) - 1
    assert res["speedup"] > 0 and res["plain_tokens_per_s"] > 0
    assert 1 <= res["tree"]["num_nodes"] <= 12
    calib = res["tree"]["calibration"]
    assert len(calib["acc"]) == 4 and all(0 <= x <= 1 for row in calib["acc"] for x in row)
    assert "tau (tokens per base forward)" in r.stdout and "speedup" in r.stdout
    # the 95% interval over the 3 items brackets the pooled tau of the records
    recs = res["records"]
    pooled = sum(x["accepted"] + x["steps"] for x in recs) / sum(x["steps"] for x in recs)
    assert pooled == pytest.approx(res["tau"])
    lo, hi = res["tau_ci95"]
    assert lo <= res["tau"] <= hi and res["intervals"]["items"] == 3
    assert res["speedup_ci95"][0] <= res["speedup"] <= res["speedup_ci95"][1]
    assert "bootstrap over the 3 items" in r.stdout
    # the saved tree is reusable as is
    again = tmp_path / "again"
    _, res2 = _eval(
        trained_heads,
        again,
        "tree=file",
        f"tree.path={out / 'tree.json'}",
        "eval.num_prompts=1",
        "eval.max_new_tokens=8",
    )
    assert res2["tree"]["paths"] == res["tree"]["paths"]
    assert (again / "config.yaml").is_file()


def test_decoding_delivers_the_acceptance_the_heads_have_on_the_decoded_texts(
    trained_heads, tiny_prepared, tmp_path
):
    """bench_calibration.py: the heads' acceptance, measured teacher-forced on the very texts an
    eval decoded, expects the tau the decoder got on its tree, and the eval's own held-out
    expectation is read back. The random tiny base's greedy replies are not the counting data
    the heads learnt, so here they are seldom accepted; the SmolLM2 figures are in the README."""
    from evaluation.benchmarks.bench_calibration import measure

    out = tmp_path / "eval"
    _, res = _eval(
        trained_heads,
        out,
        "tree=calibrated",
        "tree.budget=12",
        "tree.calibration_rows=6",
        "eval.suite=heldout",
        f"eval.prepared={tiny_prepared}",
        "eval.num_prompts=4",
        "eval.max_new_tokens=48",
        "eval.compare_plain=false",
    )
    check = measure(out, 10, {})
    assert check["nodes"] == res["tree"]["num_nodes"] and check["decoded"] == res["tau"]
    assert check["expected_held_out"] == pytest.approx(res["tree"]["expected_tau"])
    assert check["expected_own"] == pytest.approx(res["tau"], rel=0.1)


def test_eval_jsonl_prompts_multi_turn_and_bad_rows(tiny_heads, tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "count from 1 by 2"},
        {"turns": ["count from 3 by 1", "and again from 5"]},
        {"messages": [{"role": "user", "content": "count from 2"}]},
        {"nothing": 1},
        "not an object",
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    _, res = _eval(
        tiny_heads,
        tmp_path / "eval",
        f"eval.prompts={prompts}",
        "tree=branching",
        "tree.branching=[2,2]",
        "eval.max_new_tokens=10",
    )
    assert res["prompts"]["items"] == 3 and res["prompts"]["generations"] == 4  # 2 turns
    assert res["prompts"]["skipped"] == {"bad_prompt_row": 2, "invalid_json": 1}
    assert [x["turn"] for x in res["records"]] == [0, 0, 1, 0]
    assert res["tree"]["num_nodes"] == 6 and res["lossless"] is True


def test_eval_sampling_reports_without_lossless_check(tiny_heads, tmp_path):
    _, res = _eval(
        tiny_heads,
        tmp_path / "eval",
        "tree=sparse_15",
        "eval.temperature=0.8",
        "eval.num_prompts=2",
        "eval.max_new_tokens=12",
    )
    assert res["sampling"]["acceptance"] == "rejection" and res["lossless"] is None


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_eval_dynamic_tree_on_a_quantized_base_reports_its_backend(tiny_heads, tmp_path, quant):
    """tree=dynamic with the static cache, on the float32 and the int8 base: lossless against
    plain decoding of the same base is enforced for float32 and measured for int8."""
    _, res = _eval(
        tiny_heads,
        tmp_path / "eval",
        "tree=dynamic",
        "tree.budget=10",
        f"eval.base_quant={quant}",
        "eval.weight_layout=packed",
        "eval.num_prompts=2",
        "eval.max_new_tokens=12",
    )
    assert res["tree"]["kind"] == "dynamic" and res["tree"]["num_nodes"] == 10
    assert res["backend"]["base_quant"] == quant
    assert res["backend"]["weight_layout"] == "packed"
    # the float32 layers (the base's unless int8, and the heads') hold packed copies
    packed = res["backend"]["packed_rows"]
    assert packed and all(v == "1+" for v in packed.values())
    assert res["lossless"] is (True if quant == "none" else None)
    assert 0.0 <= res["identical_to_plain"] <= 1.0
    assert not (tmp_path / "eval" / "tree.json").exists()  # no one tree to save


def test_eval_auto_tree_on_a_bf16_base_calibrates_the_heads_in_its_dtype(
    trained_heads, tmp_path, monkeypatch
):
    """tree=auto on a bf16 base: the decoder's heads run in bf16, and calibration and the timed
    candidates use those same heads (a float32 calibration input would fail on them)."""
    import torch

    import evaluation.evaluate as evaluate_mod

    seen = set()
    real = evaluate_mod.calibrate

    def spy(model, heads, *a, **k):
        seen.add((next(model.parameters()).dtype, next(heads.parameters()).dtype))
        return real(model, heads, *a, **k)

    monkeypatch.setattr(evaluate_mod, "calibrate", spy)
    _, res = _eval(
        trained_heads,
        tmp_path / "eval",
        "tree=auto",
        "tree.budget=4",
        "tree.calibration_rows=4",
        "eval.base_quant=bf16",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
    )
    assert res["tree"]["kind"] == "auto" and len(res["tree"]["auto"]) >= 2
    assert res["backend"]["base_quant"] == "bf16"
    assert seen == {(torch.bfloat16, torch.bfloat16)}  # the base and heads it calibrated


def test_eval_temperature_tree_takes_the_shape_of_its_temperature(tiny_heads, tmp_path):
    _, res = _eval(
        tiny_heads,
        tmp_path / "eval",
        "tree=temperature",
        "eval.temperature=0.75",
        "eval.num_prompts=2",
        "eval.max_new_tokens=10",
    )
    # conf/tree/temperature.yaml: cold (4, 4, all 4 heads), hot (4, 8, 2) at 1.0
    tree = res["tree"]
    assert tree["kind"] == "temperature" and res["sampling"]["acceptance"] == "rejection"
    assert (tree["expand"], tree["width"], tree["depth"], tree["num_nodes"]) == (4, 7, 2, 15)


def test_eval_batched_multi_turn_chats_match_batch_1(tiny_heads, tmp_path):
    """eval.batch_size=3 over 4 chats (one of two turns): batches of 3 and 1, turn by turn;
    lossless against batched plain decoding, and the same tokens as the batch-1 eval."""
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"turns": ["count from 3 by 1", "and again from 5"]},
        {"prompt": "count from 1 by 2"},
        {"prompt": "count from 7"},
        {"prompt": "count down from 9 to 1 and then up again"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = (f"eval.prompts={prompts}", "tree=sparse_15", "eval.max_new_tokens=12")
    _, one = _eval(tiny_heads, tmp_path / "one", *args)
    _, res = _eval(tiny_heads, tmp_path / "batched", *args, "eval.batch_size=3")
    assert res["backend"]["batch_size"] == 3 and res["lossless"] is True
    assert [(r["batch"], r["batch_rows"], r["turn"]) for r in res["records"]] == [
        (0, 3, 0), (0, 3, 0), (0, 3, 0), (0, 1, 1), (1, 1, 0)
    ]  # fmt: skip
    outputs = {(r["item"], r["turn"]): r["output"] for r in one["records"]}
    assert {(r["item"], r["turn"]): r["output"] for r in res["records"]} == outputs
    assert res["tau"] == pytest.approx(one["tau"]) and res["plain_tokens_per_s"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval.compile=true", "eval.base_quant=int8"], "dynamic int8 linears do not compile"),
        (["eval.compile=true", "eval.batch_size=2"], "compiled decoding is batch 1"),
        (["eval.batch_size=0"], "eval.batch_size"),
        (["tree=dynamic", "tree.depth=9"], "tree.depth=9 but the heads propose only"),
        (["tree=temperature", "tree.hot.depth=9"], "tree.hot.depth=9 but the heads propose"),
        (["tree=temperature", "tree.hot_at=0"], "tree.hot_at"),
        (["heads=/nonexistent/heads"], "is not a heads checkpoint"),
        (["tree=paths", "tree.paths=[[0],[0,0,0]]"], "has no parent"),
        (["tree=mc_sim_7b_63", "base=smollm2_135m"], "were trained for a base"),
        (["eval.prompts=/nonexistent.jsonl"], "does not exist"),
    ],
)
def test_eval_bad_input_fails_clearly(tiny_heads, tmp_path, args, message):
    own_heads = any(a.startswith("heads=") for a in args)
    full = [*([] if own_heads else [f"heads={tiny_heads}"]), f"out={tmp_path / 'e'}", *args]
    r = run_here("eval", *full)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert message in r.stderr and "Traceback" not in r.stderr


def test_eval_default_auto_tree_picks_the_best_candidate(tiny_heads, tmp_path):
    out = tmp_path / "eval"
    fast = ["eval.num_prompts=2", "eval.max_new_tokens=8"]
    # no tree=; min_speedup 1 (its floor): the best candidate is taken, whatever the timings
    # (one under the margin leaves plain decoding: test_choose_tree.py)
    args = ("tree.budget=2", "tree.calibration_rows=2", "tree.min_speedup=1")
    _, res = _eval(tiny_heads, out, *fast, *args)
    tree = res["tree"]
    assert tree["kind"] == "auto" and "calibration" in tree and "expected_tau" in tree
    candidates = tree["auto"]
    assert candidates[0]["nodes"] == 0 and candidates[0]["expected_speedup"] == 1.0
    assert all(1 <= c["nodes"] <= 2 for c in candidates[1:])
    best = max(c["expected_speedup"] for c in candidates)
    assert yaml.safe_load((out / "config.yaml").read_text())["tree"]["min_speedup"] == 1
    assert tree["num_nodes"] in [c["nodes"] for c in candidates if c["expected_speedup"] == best]
    saved = json.loads((out / "tree.json").read_text())
    assert saved["paths"] == tree["paths"] and len(tree["paths"]) == tree["num_nodes"]
    assert res["lossless"] is True and res["mismatches"] == []
    assert res["prompts"]["items"] == 2
    # where the setup went: its parts are measured, and are parts of it
    parts = res["setup"]
    assert parts["calibrate_s"] > 0 and parts["choose_tree_s"] > 0 and parts["load_s"] > 0
    assert sum(parts.values()) <= res["setup_s"] + 0.02


@pytest.fixture(scope="module")
def heads_without_validation(tmp_path_factory, tiny_base) -> Path:
    """Heads whose recorded prep output has no validation rows (data.val_fraction=0)."""
    from data_prep.prepare import prepare

    root = tmp_path_factory.mktemp("no_val")
    data = root / "pattern.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in pattern_rows(8)))
    overrides = [f"data.path={data}", f"out={root / 'prep'}", "data.val_fraction=0"]
    prepare(prep_config(["base=tiny_random", "data=jsonl", *overrides]))
    return _save_heads(root, tiny_base, root / "prep")


@pytest.mark.parametrize("with_prompts", [True, False])
def test_eval_auto_tree_without_held_out_rows_says_what_is_missing(
    heads_without_validation, tmp_path, with_prompts
):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "count from 1 by 2"}) + "\n")
    args = [f"eval.prompts={prompts}"] if with_prompts else []
    r = run_here("eval", f"heads={heads_without_validation}", f"out={tmp_path / 'e'}", *args)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    message = next(line for line in r.stderr.splitlines() if line.startswith("error: "))
    assert "tree=auto" in message and "validation" in message and "eval.prepared=DIR" in message
    assert (
        str(heads_without_validation.parent / "prep") in message and "tree=mc_sim_7b_63" in message
    )
    assert "eval.prompts" not in message  # passing it would not help: calibration needs rows
    if with_prompts:  # the advice works: a fixed tree with the given prompts runs
        _, res = _eval(
            heads_without_validation,
            tmp_path / "fixed",
            *args,
            "tree=chain",
            "eval.max_new_tokens=4",
        )
        assert res["tree"]["kind"] == "preset" and res["lossless"] is True
