"""Every base family beyond Llama through the whole CLI, as a user with a model directory runs
it (`base=pretrained base.path=DIR`): prep with the family's chat template (multi-turn
conversations kept, reply masks ending on its end-of-turn token), regeneration by the base,
training of Medusa, Hydra and Hydra++ heads online and offline, eval (greedy speculative ==
plain, or it exits 2) on a fixed and a dynamic tree at batch 1 and batch B, export and import
back, and `plan`. The tiny random models are built from transformers' own classes
(tests/families.py)."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from tests.families import FAMILIES, TEMPLATES, save_family
from tests.helpers import conv, pattern_rows, run_here


def _data(path):
    """Counting chats: 30 single-turn and 10 two-turn ones (which Qwen3's and Phi-3's templates
    re-render as the conversation goes on)."""
    rows = pattern_rows(30)
    for i in range(10):
        a = " ".join(str((i + j) % 10) for j in range(12))
        b = " ".join(str((i + 2 * j) % 10) for j in range(12))
        rows.append(conv(("human", f"count {i}"), ("gpt", a), ("human", "by two"), ("gpt", b)))
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _ok(*args):
    r = run_here(*args)
    assert r.returncode == 0, f"{args[0]}: {r.stderr[-3000:]}"
    return r


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_through_the_cli(family, tmp_path):
    model_dir = save_family(family, tmp_path / family)
    base = ["base=pretrained", f"base.path={model_dir}", f"base.name={family}"]
    data = tmp_path / "data"
    common = ["data=jsonl", f"data.path={_data(tmp_path / 'chats.jsonl')}"]
    _ok("prep", *base, *common, f"out={data}", "data.val_fraction=0.2", "cache_hidden=true")
    stats = json.loads((data / "prep_stats.json").read_text())
    assert (stats["conversations_kept"], stats["skipped_total"]) == (40, 0), stats
    eot = TEMPLATES[family][3]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = datasets.load_from_disk(str(data))["train"]
    two_turn = [r for r in rows if "by two" in tok.decode(r["input_ids"])]
    assert two_turn, "no two-turn conversation survived prep"
    for r in two_turn:
        ids, mask = torch.tensor(r["input_ids"]), torch.tensor([0, *r["loss_mask"], 0])
        edges = torch.nonzero(mask.diff()).flatten()  # starts and ends of the masked runs
        runs = [ids[a:b] for a, b in zip(edges[::2], edges[1::2], strict=True)]
        assert len(runs) == 2 and all(tok.decode(x).endswith(eot) for x in runs), family

    # self-distillation: the base regenerates the replies (the slab strategy, windows included)
    regen = tmp_path / "regen"
    _ok("prep", *base, *common, f"out={regen}", "regenerate=true", "regen.max_new_tokens=16")
    assert json.loads((regen / "prep_stats.json").read_text())["skipped_total"] == 0

    train = ["trainer.max_steps=3", "data.batch_size=4", "trainer.val_check_interval=1000"]
    train += ["final_validation=false", "logger=none", f"data.prepared={data}"]
    for head in ("medusa", "hydra", "hydra_pp"):
        for offline in (False, True):
            out = tmp_path / f"{head}_{offline}"
            _ok("train", *base, f"head={head}", f"data.offline={offline}", f"out={out}", *train)
            assert (out / "heads" / "heads.safetensors").is_file()

    heads = tmp_path / "hydra_pp_False" / "heads"
    ev_args = ["eval.num_prompts=3", "eval.max_new_tokens=16"]
    for tree, batch in (("sparse_15", 1), ("dynamic", 3)):
        ev = tmp_path / f"eval_{tree}"
        _ok(
            "eval",
            f"heads={heads}",
            f"out={ev}",
            f"tree={tree}",
            f"eval.batch_size={batch}",
            *ev_args,
        )
        res = json.loads((ev / "eval.json").read_text())
        assert res["lossless"] is True and res["tau"] >= 1.0, res

    from safetensors.torch import load_file

    medusa = tmp_path / "medusa_False" / "heads"
    for fmt, src in (("hydra", heads), ("hf", heads), ("medusa", medusa)):
        x, back = tmp_path / f"x_{fmt}", tmp_path / f"back_{fmt}"
        _ok("export", f"heads={src}", f"format={fmt}", f"out={x}")
        _ok("import", f"src={x}", f"format={fmt}", *(base if fmt != "hf" else []), f"out={back}")
        want, got = (load_file(p / "heads.safetensors") for p in (src, back))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), fmt

    r = _ok("plan", *base, f"data.prepared={data}", "out=/x")
    assert family in r.stdout and "fits on" in r.stdout

    # Gemma-2's heads distil toward its soft-capped distribution (test_losses checks the loss)
    from tests.helpers import train_config
    from train.recipe import build_module

    module, *_ = build_module(train_config([*base, f"data.prepared={data}", "out=/x"]))
    assert module.teacher_softcap == (2.0 if family == "gemma2" else None)
