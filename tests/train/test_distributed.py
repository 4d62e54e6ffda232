"""Distributed training on CPU processes through the real CLI path: 2-process DDP (gloo) and
DeepSpeed ZeRO-2 / ZeRO-3 must train exactly what one process does with the same global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import run, run_here

pytestmark = pytest.mark.slow

COMMON = [
    "base=tiny_random",
    "head=hydra_pp",
    "head.noise_alpha=0.0",
    "head.num_heads=3",
    "logger=none",
    "trainer.max_steps=4",
    "trainer.val_check_interval=1000",
    "final_validation=false",
    "data.batch_size=2",
    "data.shuffle=true",
    "checkpoint_every=1000",
    "optim.lr=1.0e-2",
    "optim.warmup_steps=0",
]


def _train(tiny_prepared: Path, out: Path, *extra: str, cli=run) -> dict[str, torch.Tensor]:
    """`hydra-heads train` (`cli=run_here`: the same command line in this process, for the
    one-process runs, which need no interpreter of their own)."""
    r = cli("train", *COMMON, f"data.prepared={tiny_prepared}", f"out={out}", *extra)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return load_file(str(out / "heads" / "heads.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def one_process(tiny_prepared, tmp_path_factory):
    """The reference: one process (this one), batch 2, 2 micro-batches per step = global
    batch 4."""
    out = tmp_path_factory.mktemp("one") / "run"
    accumulate = ["trainer=cpu", "trainer.accumulate_grad_batches=2"]
    return _train(tiny_prepared, out, *accumulate, cli=run_here)


def test_ddp_two_processes_equal_one_process(tiny_prepared, tmp_path, one_process):
    ddp = _train(tiny_prepared, tmp_path / "ddp", "trainer=ddp_cpu", "trainer.devices=2")
    no_lr = ["trainer=cpu", "trainer.max_steps=1", "optim.lr=1.0e-12"]
    init = _train(tiny_prepared, tmp_path / "zero", *no_lr, cli=run_here)
    assert _max_diff(init, one_process) > 1e-3  # training really moved the heads
    assert _max_diff(ddp, one_process) < 1e-5


DS_CPU = [
    "trainer.accelerator=cpu",
    "trainer.precision=32-true",
    "trainer.devices=2",
    # tiny test parameters are below DeepSpeed's 1e5-element persistence threshold: without
    # this every rank would also keep a full copy of them
    "+trainer.strategy.zero_extra={stage3_param_persistence_threshold: 0}",
]


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_on_cpu_trains_like_one_process(tiny_prepared, tmp_path, one_process, stage):
    out = tmp_path / stage
    heads = _train(tiny_prepared, out, f"trainer=deepspeed_{stage}", *DS_CPU)
    assert _max_diff(heads, one_process) < 1e-5
    summary = json.loads((out / "train_summary.json").read_text())
    share = summary["base_params_on_rank0"]
    if stage == "zero3":  # the frozen base really is partitioned: rank 0 holds half of it
        assert 0.45 < share["fraction"] < 0.55, share
    else:
        assert share["fraction"] == 1.0, share
    # the consolidated heads load like any other checkpoint
    from tests.helpers import prep_config
    from train.core.base import load_base
    from train.heads import load_heads

    base = load_base(prep_config(["base=tiny_random", "out=x"]).base)
    loaded, meta = load_heads(out / "heads", base.fingerprint())
    assert meta["training"]["steps"] == 4
    state = loaded.state_dict()  # tied blocks (the default) appear under each of their names
    assert set(heads) <= set(state)  # the file holds each shared tensor once
    assert _max_diff({k: state[k] for k in heads}, heads) == 0.0


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny_random base saved as an ordinary safetensors model directory."""
    from tests.helpers import prep_config
    from train.core.base import load_base

    d = tmp_path_factory.mktemp("tiny_model")
    base = load_base(prep_config(["base=tiny_random", "out=x"]).base)
    base.model.save_pretrained(d, safe_serialization=True)
    base.tokenizer.save_pretrained(d)
    return d


def test_zero3_builds_a_pretrained_base_sharded(
    tiny_prepared, tiny_model_dir, tmp_path, one_process
):
    """A base from a model dir is never whole in one process under ZeRO-3: it is built under
    zero.Init in configure_model and rank 0 streams the weights into the shards. Training must
    still match one process that loaded the same base whole."""
    out = tmp_path / "sharded"
    as_dir = ["base.source=pretrained", f"+base.path={tiny_model_dir}"]
    z3 = ["trainer=deepspeed_zero3", *DS_CPU, *as_dir, "checkpoint_every=2"]
    heads = _train(tiny_prepared, out, *z3)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["base_load"] == "zero3_sharded", summary
    assert 0.45 < summary["base_params_on_rank0"]["fraction"] < 0.55, summary
    assert _max_diff(heads, one_process) < 1e-5
    # the deferred fingerprint (from a meta skeleton) is the loaded model's own
    from tests.helpers import prep_config
    from train.core.base import load_base
    from train.heads import load_heads

    base = load_base(prep_config(["base=tiny_random", "out=x", *as_dir]).base)
    _, meta = load_heads(out / "heads", base.fingerprint())
    assert meta["base"]["shapes_sha256"] == base.fingerprint()["shapes_sha256"]

    # Killed after step 2: only that DeepSpeed checkpoint survives. Resuming it (the base is
    # rebuilt sharded, the engine restores the heads' shards and optimizer) ends where the
    # uninterrupted run ended.
    import shutil

    ckpts = out / "checkpoints"
    for name in ("last.ckpt", "step000004.ckpt"):
        shutil.rmtree(ckpts / name)
    (out / "heads" / "heads.safetensors").unlink()
    resumed = _train(tiny_prepared, out, *z3, "resume=true")
    assert _max_diff(resumed, heads) < 1e-6
