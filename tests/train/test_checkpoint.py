"""Heads checkpoints: round trip, base mismatch errors, kill -9 and resume == uninterrupted."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import head_config, train_config
from train.core.checkpoint import HeadsMismatchError
from train.heads import base_shape, build_heads, heads_meta, load_heads, save_heads

CLI = str(Path(sys.executable).parent / "hydra-heads")


@pytest.mark.parametrize("name", ["medusa", "hydra", "hydra_pp"])
def test_save_load_round_trip(tmp_path, tiny_base, name):
    draft = torch.arange(0, 259, 3)
    heads = build_heads(
        head_config(name, num_heads=3, num_layers=2, draft_vocab_size=87),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
        draft,
    )
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_heads(tmp_path / "h", heads, heads_meta(heads, tiny_base.fingerprint(), tiny_base.cfg))
    assert {p.name for p in (tmp_path / "h").iterdir()} == {
        "heads.safetensors",
        "heads_config.json",
    }
    loaded, meta = load_heads(tmp_path / "h", tiny_base.fingerprint())
    assert meta["arch"] == name and meta["draft_vocab_size"] == 87
    x = torch.randn(1, 6, 64)
    e = torch.randn(1, 6, 64)
    heads.eval()
    for a, b in zip(heads(x, e), loaded(x, e), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(loaded.draft.to_full, draft)


def test_loading_onto_another_base_names_both_shapes(tmp_path, tiny_base):
    heads = build_heads(
        head_config("hydra", num_heads=2), base_shape(tiny_base.config), tiny_base.lm_head.weight
    )
    save_heads(tmp_path / "h", heads, heads_meta(heads, tiny_base.fingerprint(), tiny_base.cfg))
    other = dict(tiny_base.fingerprint(), hidden_size=576, vocab_size=49152, name="smollm2_135m")
    with pytest.raises(HeadsMismatchError) as e:
        load_heads(tmp_path / "h", other)
    msg = str(e.value)
    assert "hidden_size=64, vocab_size=259" in msg and "hidden_size=576, vocab_size=49152" in msg


@pytest.mark.parametrize(
    "to_full, match",
    [
        ([*range(14), 259, 300], r"2 token ids outside the vocab of 259 \(e.g. \[259, 300"),
        ([5] + list(range(1, 16)), "lists a token id twice"),
        ([-1] + list(range(1, 16)), "outside the vocab of 259"),
    ],
)  # fmt: skip
def test_a_draft_vocab_map_outside_the_base_vocab_is_a_clear_error(
    tmp_path, tiny_base, to_full, match
):
    """A heads file whose draft vocab map does not fit the base (damaged, or made for another
    vocab) is refused by name, not an IndexError from inside the lookup table."""
    from safetensors.torch import load_file, save_file

    from train.core.checkpoint import CheckpointError

    heads = build_heads(
        head_config("medusa", num_heads=2, draft_vocab_size=16),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
        torch.arange(16),
    )
    save_heads(tmp_path / "h", heads, heads_meta(heads, tiny_base.fingerprint(), tiny_base.cfg))
    weights = tmp_path / "h" / "heads.safetensors"
    state = load_file(weights)
    state["draft.to_full"] = torch.tensor(to_full)
    save_file(state, weights)
    with pytest.raises(CheckpointError, match=f"heads.safetensors.*{match}"):
        load_heads(tmp_path / "h", tiny_base.fingerprint())


def test_missing_checkpoint_files_are_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a heads checkpoint"):
        load_heads(tmp_path)


def _losses(run: Path, newest_only: bool = False) -> dict[int, float]:
    """Each logged step's train loss (`_logged`)."""
    return {step: float(loss) for step, (_, loss) in _logged(run, newest_only).items()}


def _logged(run: Path, newest_only: bool = False) -> dict[int, tuple[int, str]]:
    """step -> (epoch, train/loss as written): a later run's where runs overlap (a resumed run
    adds a log version), or (`newest_only`) the newest run's alone."""
    out = {}
    logs = sorted(run.glob("logs/version_*/metrics.csv"), key=lambda f: int(f.parent.name[8:]))
    for f in logs[-1:] if newest_only else logs:
        with open(f) as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss"):
                    out[int(row["step"])] = (int(row["epoch"]), row["train/loss"])
    return out


def _train_cmd(prepared: Path, out: Path, *extra: str) -> list[str]:
    return [
        CLI,
        "train",
        "base=tiny_random",
        f"data.prepared={prepared}",
        f"out={out}",
        "head=hydra_pp",
        "head.num_heads=2",
        "head.noise_alpha=5",
        "head.dropout=0.1",
        "trainer.max_steps=40",
        "checkpoint_every=4",
        "trainer.val_check_interval=1000",
        "final_validation=false",
        "data.batch_size=2",
        # (the samples are ~93 tokens) the steps cost a third as much; the window with the
        # most loss tokens, as the first 32 tokens are the prompt's alone: a loss of 0
        "data.max_length=32",
        "data.crop=supervised",
        *extra,
    ]


@pytest.fixture(scope="module")
def uninterrupted_losses(tiny_prepared, tmp_path_factory) -> dict[int, float]:
    """step -> loss of the uninterrupted run that both kill tests compare with: one run for
    both, and in this process (the same `hydra-heads train` command line, `run_here`)."""
    from tests.helpers import run_here

    ref = tmp_path_factory.mktemp("uninterrupted40") / "ref"
    r = run_here(*_train_cmd(tiny_prepared, ref)[1:])
    assert r.returncode == 0, r.stderr[-3000:]
    return _losses(ref)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_run_resumes_with_the_same_next_losses(
    tiny_prepared, tmp_path, sig, uninterrupted_losses
):
    """Noise and dropout on: the RNG, data position, optimizer and schedule all resume."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    want = uninterrupted_losses
    assert len(want) == 40 and min(want.values()) > 0  # every step trains on loss tokens

    run = tmp_path / "run"
    proc = subprocess.Popen(
        _train_cmd(tiny_prepared, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 300
    while not list((run / "checkpoints").glob("step*.ckpt")):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)  # at once: under load a late signal leaves few steps to resume
    proc.wait(timeout=120)
    before = _losses(run)
    assert 0 < len(before) < 40, "the run was not interrupted mid-way"
    saved = {  # the steps the killed run's checkpoints hold (its CSV log may lag them)
        torch.load(f, weights_only=False, map_location="cpu")["global_step"]
        for f in (run / "checkpoints").glob("*.ckpt")
    }
    r = subprocess.run(
        _train_cmd(tiny_prepared, run, "resume=true"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = _losses(run, newest_only=True)
    # the resumed run's steps, from one of the checkpoints' (it may re-run steps the killed
    # run had logged) to the last without a gap, each as in the uninterrupted run
    first = min(resumed)
    assert first in saved and first > 0 and sorted(resumed) == list(range(first, 40))
    for step in resumed:
        assert resumed[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    meta = json.loads((run / "heads" / "heads_config.json").read_text())
    assert meta["training"]["steps"] == 40


def test_resume_without_checkpoints_and_rerun_without_resume_fail_clearly(tiny_prepared, tmp_path):
    from train.recipe import fit

    cfg = train_config(
        [
            "base=tiny_random",
            f"data.prepared={tiny_prepared}",
            f"out={tmp_path / 'x'}",
            "resume=true",
            "logger=none",
        ]
    )
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        fit(cfg, lambda **k: None)
    (tmp_path / "x" / "checkpoints").mkdir(parents=True)
    (tmp_path / "x" / "checkpoints" / "last.ckpt").write_bytes(b"truncated")
    with pytest.raises(FileNotFoundError, match="no readable checkpoint"):
        fit(cfg, lambda **k: None)
    cfg.resume = False
    with pytest.raises(FileExistsError, match="resume=true"):
        fit(cfg, lambda **k: None)


def test_resume_auto_starts_fresh_then_continues(tiny_prepared, tmp_path):
    """resume=auto (what a requeued SLURM job runs): no checkpoint -> a new run; checkpoints,
    including Lightning's SLURM hpc_ckpt_N.ckpt in <out> -> continue from the newest."""
    from tests.helpers import run_here  # `hydra-heads train`, in this process

    out = tmp_path / "run"
    common = [
        "base=tiny_random",
        "head=hydra",
        f"data.prepared={tiny_prepared}",
        f"out={out}",
        "resume=auto",
        "logger=none",
        "final_validation=false",
        "checkpoint_every=2",
    ]
    r = run_here("train", *common, "trainer.max_steps=2")
    assert r.returncode == 0, r.stderr[-2000:]
    # what Lightning's SIGUSR1 handler leaves before requeueing: the newest checkpoint
    newest = out / "hpc_ckpt_1.ckpt"
    newest.write_bytes((out / "checkpoints" / "last.ckpt").read_bytes())
    from train.recipe import checkpoint_candidates, resume_checkpoint

    assert newest in checkpoint_candidates(out)
    assert resume_checkpoint(out / "checkpoints") == newest
    r = run_here("train", *common, "trainer.max_steps=4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming from {newest}" in r.stdout + r.stderr
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 4


# -- resume from any checkpoint, epoch boundaries included, == the uninterrupted run ------------
# 11 samples in batches of 2: 6 batches (the last one short) = 6 optimizer steps per epoch, so
# 12 steps cross one epoch boundary; a checkpoint every 2 steps lands mid-epoch (2, 4, 8, 10),
# on the last batch of an epoch (6) and at the end of the run (12).
EPOCH_STEPS, STEPS, EVERY = 6, 12, 2


@pytest.fixture(scope="module")
def eleven_prepared(tmp_path_factory) -> Path:
    """A prepared dataset of exactly 11 training samples (tiny tokenizer, no validation)."""
    from data_prep.prepare import prepare
    from tests.helpers import pattern_rows, prep_config

    root = tmp_path_factory.mktemp("eleven")
    data = root / "pattern.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in pattern_rows(11)))
    prepare(
        prep_config(
            [
                "base=tiny_random",
                "data=jsonl",
                f"data.path={data}",
                f"out={root / 'out'}",
                "data.val_fraction=0",
            ]
        )
    )
    return root / "out"


def _fit_in_process(prepared: Path, out: Path, *extra: str, callbacks=()) -> dict:
    """`hydra-heads train` as the CLI runs it (CSV logger), in this process."""
    from lightning.pytorch.loggers import CSVLogger

    from train.recipe import fit, make_trainer

    cfg = train_config(
        [
            "base=tiny_random",
            f"data.prepared={prepared}",
            f"out={out}",
            "head=hydra_pp",
            "head.num_heads=2",
            "head.noise_alpha=5",  # random streams in every step: the RNG must resume too
            "head.dropout=0.1",
            f"trainer.max_steps={STEPS}",
            f"checkpoint_every={EVERY}",
            "keep_checkpoints=100",
            "trainer.val_check_interval=1000",
            "final_validation=false",
            "data.batch_size=2",
            "data.max_length=32",  # (the samples are ~93 tokens) a third of the compute,
            "data.crop=supervised",  # on the window with the most loss tokens, not the prompt
            "optim.warmup_steps=3",  # the schedule changes slope mid-run: it must resume too
            "+trainer.enable_progress_bar=false",
            *extra,
        ]
    )

    def make(**kw):
        return make_trainer(cfg, **{**kw, "callbacks": [*kw["callbacks"], *callbacks]})

    return fit(cfg, make, logger=CSVLogger(save_dir=str(out), name="logs"))


def _heads(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "heads" / "heads.safetensors"))


def _same_heads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(eleven_prepared, tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("uninterrupted") / "ref"
    _fit_in_process(eleven_prepared, ref)
    assert min(float(loss) for _, loss in _logged(ref).values()) > 0  # every step trains
    return ref


def _resume_from(ckpt: Path, out: Path, prepared: Path) -> None:
    """A copy of the run that holds only `ckpt`, resumed (resume=true picks that one)."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / ckpt.name).write_bytes(ckpt.read_bytes())
    _fit_in_process(prepared, out, "resume=true")


def _assert_continues(run: Path, ref: Path, first_step: int) -> None:
    want, got = _logged(ref), _logged(run)
    resumed = {s: got[s] for s in got if s >= first_step}
    assert sorted(resumed) == list(range(first_step, STEPS))
    for step, (epoch, loss) in resumed.items():
        assert epoch == want[step][0], f"step {step}: logged epoch {epoch}, want {want[step][0]}"
        assert loss == want[step][1], f"step {step}: loss {loss}, want {want[step][1]}"
    assert _same_heads(_heads(run), _heads(ref))


def test_resume_from_every_checkpoint_equals_the_uninterrupted_run(
    uninterrupted, eleven_prepared, tmp_path
):
    """Each checkpoint of a run that crosses an epoch boundary, the one written on the last
    batch of epoch 0 included, resumes to the same batches, epochs, losses and final heads."""
    ref = uninterrupted
    logged = _logged(ref)
    assert {s: e for s, (e, _) in logged.items()} == {s: s // EPOCH_STEPS for s in range(STEPS)}
    ckpts = sorted((ref / "checkpoints").glob("step*.ckpt"))
    assert [c.name for c in ckpts] == [f"step{s:06d}.ckpt" for s in range(EVERY, STEPS + 1, EVERY)]
    for ckpt in ckpts:
        step = int(ckpt.stem.removeprefix("step"))
        run = tmp_path / ckpt.stem
        _resume_from(ckpt, run, eleven_prepared)
        _assert_continues(run, ref, step)


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_train_epoch_end"])
def test_sigterm_at_an_epoch_end_resumes_like_the_uninterrupted_run(
    uninterrupted, eleven_prepared, tmp_path, hook
):
    """SIGTERM noticed after epoch 0's last batch: Lightning stops at the end of that batch
    or of the epoch, SaveOnInterrupt writes last.ckpt, and resuming it continues exactly."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class Sigterm(pl.Callback):
        """What Lightning's SIGTERM handler does: set the flag its loops check."""

        def _at(self, trainer):
            if trainer.global_step == EPOCH_STEPS:
                trainer._signal_connector.received_sigterm = True

        def on_train_batch_end(self, trainer, *args):
            if hook == "on_train_batch_end":
                self._at(trainer)

        def on_train_epoch_end(self, trainer, *args):
            if hook == "on_train_epoch_end":
                self._at(trainer)

    run = tmp_path / "run"
    with pytest.raises(SIGTERMException):
        _fit_in_process(eleven_prepared, run, callbacks=[Sigterm()])
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == EPOCH_STEPS
    for f in (run / "checkpoints").glob("step*.ckpt"):
        f.unlink()  # resume from the interrupt checkpoint, not from step000006.ckpt
    _fit_in_process(eleven_prepared, run, "resume=true")
    _assert_continues(run, uninterrupted, EPOCH_STEPS)
