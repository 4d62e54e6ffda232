"""What a resumed run tells the user: where its data continues, and no false warning that the
data position is lost (PreparedDataModule restores it exactly)."""

from __future__ import annotations

from tests.helpers import run_here


def test_mid_epoch_resume_logs_the_position_and_not_lightnings_warning(tiny_prepared, tmp_path):
    # 51 training samples in batches of 4: 13 batches an epoch, so step 3 is mid-epoch
    out = tmp_path / "run"
    common = [
        "train",
        "base=tiny_random",
        "head=hydra",
        "head.num_heads=2",
        f"data.prepared={tiny_prepared}",
        f"out={out}",
        "resume=auto",
        "logger=none",
        "final_validation=false",
        "val_tau.prompts=0",
        "checkpoint_every=3",
        "+trainer.enable_progress_bar=false",
    ]
    r = run_here(*common, "trainer.max_steps=3")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_here(*common, "trainer.max_steps=5")
    assert r.returncode == 0, r.stderr[-2000:]
    text = r.stdout + r.stderr
    assert "resumed data position: step 3 -> epoch 0 from its batch 3 of 13" in text, text
    assert "not resumable" not in text, text
    assert text.count("resumed data position") == 1
    # another head config on the same out= is refused before a step, naming what changed
    r = run_here(*common, "trainer.max_steps=7", "head.noise_alpha=2.0", "head.loss.chunk_size=64")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "another head config (head.noise_alpha: 0.0 in the checkpoint, 2.0 now)" in r.stderr
    ckpts = out / "checkpoints"
    steps = sorted(p.name for p in ckpts.glob("step*.ckpt"))
    assert steps and steps[-1] <= "step000005.ckpt", steps  # no step trained under the new one
