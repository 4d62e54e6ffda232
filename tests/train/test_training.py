"""Training on tiny_random: every head learns, the base stays frozen, offline == online."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import head_config, train_config
from train.core.errors import ConfigError
from train.heads import HEADS
from train.recipe import build_module


def _cfg(prepared, tmp_path, *extra):
    return train_config(
        [
            "base=tiny_random",
            f"data.prepared={prepared}",
            f"out={tmp_path / 'run'}",
            "logger=none",
            "trainer.max_steps=25",
            "data.batch_size=4",
            "optim.lr=3e-3",
            "optim.warmup_steps=2",
            *extra,
        ]
    )


class LossLog:
    def __init__(self):
        self.losses = []

    def __call__(self, module):
        import lightning.pytorch as pl

        log = self

        class CB(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                log.losses.append(float(outputs["loss"]))

        return CB()


def _fit(module, dm, steps, callbacks=(), **trainer_kw):
    import lightning.pytorch as pl

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        **trainer_kw,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=dm)
    return trainer


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_learns_and_the_base_stays_frozen(tiny_prepared, tmp_path, name):
    # eagle-attn, cross-attn: one head, its lm head the base's, frozen; eagle3: 2 unrolled
    # steps, its own lm head trained
    cls = HEADS[name]
    one = cls.recurrent and not cls.unrolled
    cfg = _cfg(tiny_prepared, tmp_path, f"head={name}", f"head.num_heads={1 if one else 2}")
    module, dm, *_ = build_module(cfg)
    base_before = {k: v.clone() for k, v in module.base_model.state_dict().items()}
    frozen = {k: v.clone() for k, v in module.heads.named_parameters() if not v.requires_grad}
    assert bool(frozen) == one
    log = LossLog()
    trainer = _fit(module, dm, 25, [log(module)])
    first, last = sum(log.losses[:5]) / 5, sum(log.losses[-5:]) / 5
    assert last < 0.8 * first, log.losses
    after = module.base_model.state_dict()
    assert all(torch.equal(base_before[k], after[k]) for k in base_before)
    assert all(not p.requires_grad for p in module.base_model.parameters())
    assert not module.base_model.training
    opt_params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in module.heads.parameters() if p.requires_grad}
    heads_after = dict(module.heads.named_parameters())
    assert all(torch.equal(v, heads_after[k]) for k, v in frozen.items())


def test_offline_equals_online_on_the_same_batch(tiny_prepared, tmp_path):
    online, dm, *_ = build_module(_cfg(tiny_prepared, tmp_path))
    offline, dm_off, *_ = build_module(_cfg(tiny_prepared, tmp_path, "data.offline=true"))
    offline.heads.load_state_dict(online.heads.state_dict())
    assert offline.base_model is None
    dm.setup()
    dm_off.setup()
    batch_on = next(iter(dm.train_dataloader()))
    batch_off = next(iter(dm_off.train_dataloader()))
    assert torch.equal(batch_on["input_ids"], batch_off["input_ids"])
    assert "hidden" in batch_off and "hidden" not in batch_on
    loss_on, heads_on = online.compute(batch_on)
    loss_off, heads_off = offline.compute(batch_off)
    assert torch.allclose(loss_on, loss_off, rtol=2e-3, atol=1e-4)
    for a, b in zip(heads_on, heads_off, strict=True):
        assert a["n"] == b["n"]


def test_offline_needs_cached_states(tmp_path):
    import json

    from data_prep.prepare import prepare
    from tests.helpers import pattern_rows, prep_config
    from train.data import PreparedDataError

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in pattern_rows(10)))
    prepare(
        prep_config(
            ["base=tiny_random", "data=jsonl", f"data.path={data}", f"out={tmp_path / 'p'}"]
        )
    )
    with pytest.raises(PreparedDataError, match="cache_hidden=true"):
        build_module(_cfg(tmp_path / "p", tmp_path, "data.offline=true"))


def test_prepared_dir_errors(tmp_path):
    from train.data import PreparedDataError

    with pytest.raises(PreparedDataError, match="does not exist"):
        build_module(_cfg(tmp_path / "nope", tmp_path))
    (tmp_path / "half").mkdir()
    with pytest.raises(PreparedDataError, match="not a complete"):
        build_module(_cfg(tmp_path / "half", tmp_path))


def test_data_prepared_for_another_tokenizer_is_refused(tiny_prepared, tmp_path):
    from train.data import PreparedDataError, load_prepared

    with pytest.raises(PreparedDataError, match="another tokenizer"):
        load_prepared(tiny_prepared, vocab_size=100)


def test_data_prepared_for_another_base_of_the_same_vocab_size_is_refused(
    tiny_prepared, tiny_tokenizer, tmp_path
):
    """Token ids that fit are not enough: prep records its tokenizer's fingerprint and the
    width of the states it cached, and train and eval compare them with their base's."""
    import json
    import shutil

    from train.core.errors import ConfigError
    from train.core.prompts import check_prepared_base

    stats = json.loads((tiny_prepared / "prep_stats.json").read_text())
    H = stats["cached_hidden_size"]
    check_prepared_base(tiny_prepared, tiny_tokenizer, "data.prepared", H)  # its own base
    other = tmp_path / "other"
    shutil.copytree(tiny_prepared, other)
    (other / "prep_stats.json").write_text(json.dumps({**stats, "cached_hidden_size": H * 2}))
    check_prepared_base(other, tiny_tokenizer, "data.prepared")  # online: the states unused
    with pytest.raises(ConfigError, match=f"hidden states of width {H * 2} .* hidden size is {H}"):
        build_module(_cfg(other, tmp_path, "data.offline=true"))
    (other / "prep_stats.json").write_text(json.dumps({**stats, "tokenizer": "0123456789abcdef"}))
    with pytest.raises(ConfigError, match="tokenized for another base .*tokenizer 0123456789ab"):
        build_module(_cfg(other, tmp_path))


def test_bucket_sampler_is_deterministic_and_splits_ranks():
    import numpy as np

    from train.data import BucketBatchSampler

    lengths = np.random.default_rng(0).integers(5, 100, 103)
    a = list(BucketBatchSampler(lengths, 4, seed=1, bucket_batches=4))
    assert a == list(BucketBatchSampler(lengths, 4, seed=1, bucket_batches=4))
    s = BucketBatchSampler(lengths, 4, seed=1, bucket_batches=4)
    s.set_epoch(1)
    assert list(s) != a
    r0 = list(BucketBatchSampler(lengths, 4, 1, bucket_batches=4, rank=0, world=2))
    r1 = list(BucketBatchSampler(lengths, 4, 1, bucket_batches=4, rank=1, world=2))
    assert len(r0) == len(r1) == len(a) // 2
    assert not {i for b in r0 for i in b} & {i for b in r1 for i in b}
    # Within a bucket, batches hold similar lengths: far less padding than random batches.
    pad = sum(max(lengths[b]) * len(b) - sum(lengths[b]) for b in a)
    rnd = np.random.default_rng(0).permutation(103)
    pad_rnd = sum(
        max(lengths[rnd[i : i + 4]]) * 4 - sum(lengths[rnd[i : i + 4]]) for i in range(0, 100, 4)
    )
    assert pad < 0.5 * pad_rnd
    skip = BucketBatchSampler(lengths, 4, seed=1, bucket_batches=4)
    skip.skip = 5
    assert list(skip) == a[5:]


def test_resume_position_counts_optimizer_steps_not_epochs():
    """(epoch, batches done in it) from the steps alone: a checkpoint on an epoch's last batch
    resumes at the next epoch's start; the short last step of an epoch under accumulation."""
    from train.data import epoch_batches, resume_position

    assert resume_position(0, 6) == (0, 0)
    assert resume_position(5, 6) == (0, 5)
    assert resume_position(6, 6) == (1, 0)  # the last batch of epoch 0 done: epoch 1 next
    assert resume_position(8, 6) == (1, 2)
    assert resume_position(3, 6, accumulate=2) == (1, 0)
    # 6 batches, 4 per step: steps of 4 + 2 batches (Lightning steps at the epoch's end)
    assert [resume_position(s, 6, accumulate=4) for s in range(4)] == [
        (0, 0),
        (0, 4),
        (1, 0),
        (1, 4),
    ]
    assert epoch_batches(6) == epoch_batches(6, 1.0) == 6
    assert epoch_batches(6, 4) == 4 and epoch_batches(6, 0.5) == 3


def test_resumed_sampler_keeps_its_epoch_whatever_set_epoch_says():
    """Lightning calls set_epoch with its own counter before the first resumed iteration; the
    resumed position wins there, and set_epoch rules every later epoch."""
    import numpy as np

    from train.data import BucketBatchSampler

    lengths = np.random.default_rng(0).integers(5, 100, 40)
    epochs = []
    for e in (1, 2):
        s = BucketBatchSampler(lengths, 4, seed=1, bucket_batches=4)
        s.set_epoch(e)
        epochs.append(list(s))
    s = BucketBatchSampler(lengths, 4, seed=1, bucket_batches=4)
    s.resume_at(1, 3)
    s.set_epoch(2)  # off by one
    assert list(s) == epochs[0][3:]
    s.set_epoch(2)
    assert list(s) == epochs[1]


def test_hidden_state_offset_reads_an_earlier_layer(tiny_prepared, tmp_path):
    """head.hidden_state_offset=1: the heads read the output of the layer before the last
    (hidden_states[-2], pre-norm), not the final normed state that offset 0 reads."""
    m0, dm, *_ = build_module(_cfg(tiny_prepared, tmp_path, "head=medusa"))
    m1, _, *_ = build_module(
        _cfg(tiny_prepared, tmp_path, "head=medusa", "head.hidden_state_offset=1")
    )
    m1.heads.load_state_dict(m0.heads.state_dict())
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    seen = {}
    for name, m in (("0", m0), ("1", m1)):
        # a pre-hook that returns a value replaces the arguments: record, return None
        def record(mod, args, name=name) -> None:
            seen.setdefault(name, args[0])

        m.heads.register_forward_pre_hook(record)
        m.compute(batch)
    with torch.no_grad():
        out = m0.base_model.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
        )
    assert torch.equal(seen["0"], out.last_hidden_state)
    assert torch.equal(seen["1"], out.hidden_states[-2])
    assert not torch.allclose(seen["1"], out.last_hidden_state)


def test_heads_with_biases_start_as_the_base_and_train_their_biases(tiny_prepared, tmp_path):
    """head.bias=true (zankner/Hydra's layout): zero biases at start, trained like the rest."""
    cfg = _cfg(tiny_prepared, tmp_path, "head=hydra", "head.num_heads=2", "head.bias=true")
    module, dm, *_ = build_module(cfg)
    biases = [lm.bias for lm in module.heads.lm_heads] + [
        mlp[0].proj.bias for mlp in module.heads.mlps
    ]
    assert all(b is not None and not b.any() for b in biases)
    _fit(module, dm, 5)
    assert all(b.abs().sum() > 0 for b in biases)


def test_frozen_lm_heads_stay_the_bases_rows_while_the_rest_learns(tiny_prepared, tmp_path):
    """head.freeze_lm_heads=true (an extra): no optimizer state and no change for the output
    projections, which stay the base's lm_head; the blocks and Hydra++'s layer still learn."""
    extra = ["head=hydra_pp", "head.num_heads=2", "head.num_layers=1"]
    frozen_cfg = _cfg(tiny_prepared, tmp_path, *extra, "head.freeze_lm_heads=true")
    module, dm, *_ = build_module(frozen_cfg)
    base_rows = module.base_model.get_output_embeddings().weight.detach().clone()
    others = {k: v.clone() for k, v in module.heads.named_parameters() if "lm_heads" not in k}
    log = LossLog()
    trainer = _fit(module, dm, 25, [log(module)])
    assert sum(log.losses[-5:]) < 0.8 * sum(log.losses[:5]), log.losses
    for lm in module.heads.lm_heads:
        assert not lm.weight.requires_grad and torch.equal(lm.weight, base_rows)
    opt_params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not opt_params & {id(lm.weight) for lm in module.heads.lm_heads}
    after = dict(module.heads.named_parameters())
    assert all(not torch.equal(v, after[k]) for k, v in others.items() if v.ndim == 2)
    trained, *_ = build_module(_cfg(tiny_prepared, tmp_path, *extra))
    assert all(lm.weight.requires_grad for lm in trained.heads.lm_heads)


def test_frozen_lm_heads_refuse_the_official_random_biases():
    assert head_config("hydra", freeze_lm_heads=True, bias=True).freeze_lm_heads  # zero biases
    with pytest.raises(ConfigError, match="'bias'.*freeze_lm_heads=true and head.init=official"):
        head_config("hydra", freeze_lm_heads=True, bias=True, init="official")
    assert head_config("hydra", freeze_lm_heads=True, bias=False, init="official").bias is False


def test_bf16_autocast_step_matches_fp32_and_slow_cpus_are_warned(
    tiny_prepared, tmp_path, monkeypatch, caplog
):
    """trainer.precision=bf16-mixed runs the step under CPU autocast (the loss's big matmuls
    in bf16, softmax in fp32): loss and gradients stay close to fp32. On a CPU without bf16
    units it would be slow, and fit warns."""
    import logging

    import lightning.pytorch as pl

    import train.recipe as recipe

    module, dm, *_ = build_module(_cfg(tiny_prepared, tmp_path, "data.offline=true"))
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    params = [p for p in module.heads.parameters() if p.requires_grad]
    results = []
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = module.compute(batch)
        results.append(
            (loss.detach(), torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
        )
    (l32, g32), (l16, g16) = results
    assert torch.allclose(l16, l32, rtol=2e-2)
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99
    assert not torch.equal(g16, g32)  # autocast really changed the arithmetic

    def trainer(precision):
        return pl.Trainer(accelerator="cpu", precision=precision, logger=False)

    monkeypatch.setattr(recipe, "cpu_has_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="train.recipe"):
        assert recipe.warn_slow_cpu_bf16(trainer("bf16-mixed"))
    assert "without bf16 units" in caplog.text
    assert not recipe.warn_slow_cpu_bf16(trainer("32-true"))
    monkeypatch.setattr(recipe, "cpu_has_bf16", lambda: True)
    assert not recipe.warn_slow_cpu_bf16(trainer("bf16-mixed"))


def test_cpu_bf16_units_come_from_the_cpu_flags_not_from_onednn(monkeypatch):
    """oneDNN calls bf16 'supported' on any AVX-512 CPU (it emulates it there, several times
    slower than float32); only AVX512-BF16 or AMX-BF16 in the CPU's flags count."""
    from train.core import hardware

    def caps(**flags):
        return lambda: {"avx512_f": True, "avx512_bw": True, **flags}

    for flags, want in [({}, False), ({"avx512_bf16": True}, True), ({"amx_bf16": True}, True)]:
        monkeypatch.setattr(torch.cpu, "get_capabilities", caps(**flags))
        hardware.cpu_has_bf16.cache_clear()
        assert hardware.cpu_has_bf16() is want, flags
    hardware.cpu_has_bf16.cache_clear()


def test_precision_auto_resolves_from_the_cpu_and_is_logged(
    tiny_prepared, tmp_path, monkeypatch, caplog
):
    import logging

    from train.core import hardware
    from train.recipe import make_trainer

    cfg = _cfg(tiny_prepared, tmp_path, "trainer.precision=auto")
    for units, want in [(False, "32-true"), (True, "bf16-mixed")]:
        monkeypatch.setattr(hardware, "cpu_has_bf16", lambda u=units: u)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="train.recipe"):
            trainer = make_trainer(cfg, logger=False)
        assert trainer.precision == want
        assert f"trainer.precision=auto -> {want}" in caplog.text
    # a precision named outright is used as it is, whatever the CPU
    fixed = _cfg(tiny_prepared, tmp_path, "trainer.precision=32-true")
    assert make_trainer(fixed, logger=False).precision == "32-true"
    assert hardware.resolve_precision("bf16-mixed", "cpu") == ("bf16-mixed", "as configured")


def test_an_unknown_precision_is_refused_before_any_work(tiny_prepared, tmp_path):
    from train.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.precision.*'bf17'.*one of auto, 32-true"):
        _cfg(tiny_prepared, tmp_path, "trainer.precision=bf17")


def test_progress_is_logged_where_the_console_is_not_a_terminal(tiny_prepared, tmp_path, caplog):
    """A SLURM or nohup log sees no rich bar until the end: LogProgress writes lines."""
    import logging

    from train.recipe import LogProgress, fit, make_trainer

    cfg = _cfg(tiny_prepared, tmp_path, "trainer.max_steps=3", "final_validation=false")

    def make(**kw):
        return make_trainer(cfg, **{**kw, "callbacks": [*kw["callbacks"], LogProgress(0.0)]})

    with caplog.at_level(logging.INFO, logger="train.recipe"):
        fit(cfg, make)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [x.split(",")[0] for x in lines] == ["step 1/3", "step 2/3", "step 3/3"], lines
    assert " s a step, about " in lines[0] and " min left, train/loss " in lines[0], lines
    assert "min left" not in lines[-1]


def test_progress_bar_shows_steps_not_a_negative_epoch_total(tiny_prepared, tmp_path):
    """A run budgeted in steps (max_epochs=-1) has no epoch total: the bar says `Epoch N`, not
    Lightning's `Epoch N/-2`, and counts optimizer steps out of trainer.max_steps."""
    import lightning.pytorch as pl

    from train.recipe import StepProgressBar, fit, make_trainer

    seen, bars = [], []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bar = trainer.progress_bar_callback
            bars.append(bar)
            if bar is None:
                return
            task = bar.progress.tasks[bar.train_progress_bar_id]
            seen.append((type(bar), task.description, bar.get_metrics(trainer, pl_module)))

    cfg = _cfg(tiny_prepared, tmp_path, "trainer.max_steps=3", "final_validation=false")

    def make(**kw):
        return make_trainer(cfg, **{**kw, "callbacks": [*kw["callbacks"], Probe()]})

    fit(cfg, make)
    assert [s[0] for s in seen] == [StepProgressBar] * 3
    assert all(d.strip() == "Epoch 0" for _, d, _ in seen), seen
    assert [m["step"] for *_, m in seen] == ["1/3", "2/3", "3/3"]
    # Off where the trainer turns progress bars off, as before (no error, no bar).
    off = _cfg(tiny_prepared, tmp_path / "off", "trainer.max_steps=1", "final_validation=false")

    def make_off(**kw):
        kw = {**kw, "callbacks": [*kw["callbacks"], Probe()], "enable_progress_bar": False}
        return make_trainer(off, **kw)

    fit(off, make_off)
    assert len(seen) == 3 and len(bars) == 4 and bars[-1] is None


@pytest.mark.parametrize(
    "kind", ["reverse_kl", "jsd", "tv", "lk", "top1", "mix"]
)  # kl: test_every_head_learns_and_the_base_stays_frozen
def test_every_distillation_kind_trains_from_config(tiny_prepared, tmp_path, kind):
    """head.loss.kind (and a mix) as a user sets it: the loss falls and the checkpoint's config
    records the kind."""
    extra = ["head.loss.mix={kl: 0.5, lk: 0.5}"] if kind == "mix" else []
    cfg = _cfg(tiny_prepared, tmp_path, "head=hydra_pp", "head.num_heads=2",
               f"head.loss.kind={kind}", *extra)  # fmt: skip
    assert cfg.head.loss.distill_kinds() == ({"kl": 0.5, "lk": 0.5} if kind == "mix" else {kind: 1})
    module, dm, *_ = build_module(cfg)
    log = LossLog()
    _fit(module, dm, 25, [log(module)])
    first, last = sum(log.losses[:5]) / 5, sum(log.losses[-5:]) / 5
    assert last < 0.9 * first, log.losses
    assert module.heads.cfg.loss.kind == kind


def test_max_train_samples_trains_on_a_seeded_subset(tiny_prepared, tmp_path):
    from train.data import load_prepared, train_subset

    full = load_prepared(str(tiny_prepared))["train"]
    assert len(full) > 3
    a, b = train_subset(full, 3, 0), train_subset(full, 3, 0)
    assert len(a) == 3 and a["input_ids"] == b["input_ids"]  # the same draw every time
    assert train_subset(full, None, 0) is full and train_subset(full, 10**6, 0) is full
    draws = {tuple(map(tuple, train_subset(full, 3, s)["input_ids"])) for s in range(6)}
    assert len(draws) > 1  # the seed picks the subset
    cfg = _cfg(tiny_prepared, tmp_path, "head=hydra", "data.max_train_samples=3")
    _, dm, *_ = build_module(cfg)
    rows = sum(batch["input_ids"].shape[0] for batch in dm.train_dataloader())
    assert rows == 3  # one epoch is the subset


def test_heads_step_with_fused_adamw_equal_to_the_per_tensor_one(tiny_prepared, tmp_path):
    """configure_optimizers gives torch's fused AdamW (one kernel for all head parameters);
    its step lands where the per-tensor AdamW's does, and Lightning's gradient clipping runs
    with it under bf16-mixed, whose precision plugin refuses optimizers that unscale
    gradients themselves."""
    import copy

    module, dm, *_ = build_module(_cfg(tiny_prepared, tmp_path, "data.offline=true"))
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    start = torch.cat([p.detach().flatten() for p in module.heads.parameters() if p.requires_grad])
    fused = module.configure_optimizers()["optimizer"]
    assert fused.defaults["fused"] is True
    reference = copy.deepcopy(module)
    reference._fused_adamw = lambda: False  # the same groups and learning rates, per tensor
    loop = reference.configure_optimizers()["optimizer"]
    assert not loop.defaults["fused"]
    for mod, opt in ((module, fused), (reference, loop)):
        for _ in range(3):
            loss, _ = mod.compute(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    got = torch.cat([p.detach().flatten() for p in module.heads.parameters() if p.requires_grad])
    want = torch.cat(
        [p.detach().flatten() for p in reference.heads.parameters() if p.requires_grad]
    )
    assert got.shape == start.shape and not torch.equal(got, start)  # the steps moved them
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    trainer = _fit(module, dm, 2, precision="bf16-mixed", gradient_clip_val=1.0)
    assert trainer.global_step == 2 and trainer.optimizers[0].defaults["fused"] is True


def test_supervised_crop_trains_on_the_window_with_the_most_loss_tokens():
    import numpy as np

    from train.data import collate, window_start

    # 0 = prompt, 1 = trained on: the densest 4-token window starts at 6 (the first of two)
    mask = [0, 0, 0, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1]
    assert window_start(np.array(mask), 4) == 6
    assert window_start(np.array(mask), 40) == 0  # a sample that fits is kept whole
    cols = {
        "input_ids": [np.arange(100, 115), np.arange(200, 203)],
        "loss_mask": [np.array(mask), np.array([0, 1, 1])],
        "seq_lens": [np.array([5, 10]), np.array([3])],
        "hidden": [np.arange(15, dtype=np.float32)[:, None], np.zeros((3, 1), np.float32)],
    }
    start = collate(cols, pad_id=0, max_length=4)
    crop = collate(cols, pad_id=0, max_length=4, crop="supervised")
    assert start["input_ids"][0].tolist() == [100, 101, 102, 103]
    assert crop["input_ids"][0].tolist() == [106, 107, 108, 109]
    assert crop["loss_mask"][0].tolist() == [True] * 4
    assert crop["segment_ids"][0].tolist() == [1, 1, 1, 1]  # packed segments cut alike
    assert crop["hidden"][0, :, 0].tolist() == [6.0, 7.0, 8.0, 9.0]  # cached states too
    assert crop["input_ids"][1].tolist() == [200, 201, 202, 0]  # short rows: unchanged
    assert crop["attention_mask"][1].tolist() == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="crop='middle'"):
        collate(cols, pad_id=0, max_length=4, crop="middle")


def test_supervised_crop_shapes_training_batches_only(tiny_prepared, tmp_path):
    import numpy as np

    from train.data import load_prepared

    train = load_prepared(str(tiny_prepared))["train"]
    first = [np.asarray(m[:16]).sum() for m in train["loss_mask"]]
    assert min(len(x) for x in train["input_ids"]) > 16  # every sample is cut
    args = ("data.max_length=16", "data.shuffle=false", "data.max_val_samples=4")
    _, dm_start, *_ = build_module(_cfg(tiny_prepared, tmp_path, *args))
    _, dm_crop, *_ = build_module(_cfg(tiny_prepared, tmp_path, *args, "data.crop=supervised"))
    trained = {}
    for name, dm in (("start", dm_start), ("supervised", dm_crop)):
        dm.setup()
        trained[name] = sum(int(b["loss_mask"].sum()) for b in dm.train_dataloader())
        val = [b["input_ids"] for b in dm.val_dataloader()]
        trained[name + "_val"] = val
    assert trained["start"] == sum(first)
    assert trained["supervised"] > trained["start"]  # more loss tokens per step
    for a, b in zip(trained["start_val"], trained["supervised_val"], strict=True):
        assert torch.equal(a, b)  # validation reads every sample from its start
    with pytest.raises(Exception, match="data.crop"):
        build_module(_cfg(tiny_prepared, tmp_path, "data.crop=middle"))
    # data.val_max_length: short training windows, validation on longer contexts
    _, dm_long, *_ = build_module(_cfg(tiny_prepared, tmp_path, *args, "data.val_max_length=24"))
    dm_long.setup()
    assert max(b["input_ids"].shape[1] for b in dm_long.train_dataloader()) == 16
    assert max(b["input_ids"].shape[1] for b in dm_long.val_dataloader()) == 24
