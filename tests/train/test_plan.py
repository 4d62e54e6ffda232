"""`hydra-heads plan`: per-device memory estimates, verdicts, and the estimate checked against
the measured peak memory of real CPU training runs."""

from __future__ import annotations

import pytest

from tests.helpers import run, run_here, train_config
from train.plan import base_arch, base_params, estimate, verdict

LLAMA70 = ["base=llama2_70b", "out=/x", "data.prepared=/p", "data.max_length=2048"]


def test_recipe_plan_fits_and_prints_a_table():
    r = run("plan", "experiment=llama2_70b_4x8xa100_zero3", "data.prepared=/p", "out=/x")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "base weights (1/world + gathered layer)" in r.stdout and "fits on a100_80gb" in r.stdout


def test_zero3_shards_the_base_and_ddp_does_not_fit_70b():
    ddp = train_config([*LLAMA70, "trainer=ddp"])
    z3 = train_config([*LLAMA70, "trainer=deepspeed_zero3", "trainer.num_nodes=4"])
    arch = base_arch(ddp.base)
    e_ddp, e_z3 = estimate(ddp, arch), estimate(z3, arch)
    assert e_ddp["params"]["base"] == pytest.approx(69e9, rel=0.01)  # Llama-2-70B
    assert e_ddp["rows"]["base weights"] == pytest.approx(e_ddp["params"]["base"] * 2)
    from train.plan import base_params

    total, layer = base_params(arch)
    z3_base = e_z3["rows"]["base weights (1/world + gathered layer)"]
    assert z3_base == pytest.approx((total / 32 + 2 * layer) * 2)  # 1/32 of it + one layer
    v = verdict(ddp, arch, 80)
    assert not v["fits"] and "deepspeed_zero3" in v["suggestion"] and v["suggestion_gb"] < 80 * 0.95
    # in this process (test_recipe_plan_fits_and_prints_a_table runs `hydra-heads plan` itself)
    r = run_here("plan", *LLAMA70, "trainer=ddp")
    assert r.returncode == 0 and "does not fit" in r.stdout and "smallest change" in r.stdout


def test_frozen_lm_heads_are_weights_without_grads_or_adamw_states():
    """head.freeze_lm_heads=true: the K lm heads (V x H rows and biases) leave the trained
    parameters (grads, AdamW) for a row of their own, and the loss keeps no dL/dW for them."""
    base = [*LLAMA70, "trainer=deepspeed_zero3", "trainer.num_nodes=4", "head=hydra_pp"]
    trained, frozen = train_config(base), train_config([*base, "head.freeze_lm_heads=true"])
    arch = base_arch(trained.base)
    e_t, e_f = estimate(trained, arch), estimate(frozen, arch)
    K, V, H = trained.head.num_heads, arch["vocab_size"], arch["hidden_size"]
    V_out = min(trained.head.draft_vocab_size or V, V)
    lm = K * V_out * (H + trained.head.bias)  # weights and biases (hydra_pp's: true)
    assert e_t["params"]["heads_frozen"] == 0 and "heads frozen lm heads" not in e_t["rows"]
    assert e_f["params"]["heads_frozen"] == lm
    assert e_f["params"]["heads"] == e_t["params"]["heads"] - lm
    assert e_f["rows"]["heads frozen lm heads"] == lm * 4
    assert e_f["rows"]["heads AdamW states"] < e_t["rows"]["heads AdamW states"]
    loss = "loss: gathered states + saved grads"
    assert e_t["rows"][loss] - e_f["rows"][loss] == pytest.approx(K * V_out * H * 4)
    assert all(b >= 0 for b in e_f["rows"].values())


def test_a_partial_base_arch_names_the_missing_keys():
    from train.core.errors import ConfigError

    base = train_config([*LLAMA70, "trainer=ddp"]).base
    partial = base.model_copy(update={"arch": {"hidden_size": 8192, "vocab_size": 32000}})
    with pytest.raises(ConfigError, match="llama2_70b lacks num_hidden_layers, intermediate_size"):
        base_arch(partial)
    moe = {**base.arch, "moe_intermediate_size": 64, "num_experts": 4}
    moe.pop("intermediate_size")
    assert base_arch(base.model_copy(update={"arch": moe}))["moe_intermediate_size"] == 64


def test_unknown_gpu_is_a_clear_error():
    r = run_here("plan", "gpu=tpu_v9", "out=/x", "data.prepared=/p", "base=tiny_random")
    assert r.returncode == 2 and "gpu='tpu_v9'" in r.stderr


MEASURE = """
import json, sys
from tests.helpers import train_config
from train.plan import PeakRSS, base_arch, estimate
from train.recipe import fit, make_trainer

cfg = train_config(sys.argv[1:])
est = estimate(cfg, base_arch(cfg.base))
with PeakRSS() as m:  # the trainer as `train` builds it (precision=auto resolved, as logged)
    fit(cfg, lambda **kw: make_trainer(cfg, **{**kw, "enable_progress_bar": False}), False)
need = est["total"] + est["runtime_overhead"]
print(json.dumps({"estimate": need, "measured": m.peak - m.start}))
"""


def _measured_vs_estimated(overrides):
    """Estimate / measured peak (resident memory added by a real fit), in a fresh process: one
    that has already freed memory would reuse it and measure less."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", MEASURE, *overrides], capture_output=True, text=True, cwd=repo
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return res["estimate"] / res["measured"]


COMMON = [
    "logger=none",
    "trainer.max_steps=3",
    "final_validation=false",
    "trainer.val_check_interval=1000",
]


def test_estimate_within_25_percent_of_measured_peak_tiny(tiny_prepared, tmp_path):
    # The plan assumes batches filled to data.max_length, and batches are padded only to their
    # longest sample: give it the length the tiny samples have (94 tokens), or the formula is
    # checked against a third less data than it was told (estimate/measured 1.24-1.28 at 128).
    import datasets

    longest = max(
        len(x) for x in datasets.load_from_disk(str(tiny_prepared / "train"))["input_ids"]
    )
    ratio = _measured_vs_estimated(
        [
            *COMMON,
            "base=tiny_random",
            "base.tiny.hidden_size=512",
            "base.tiny.intermediate_size=1536",
            "base.tiny.num_hidden_layers=4",
            "base.tiny.num_attention_heads=8",
            "base.tiny.num_key_value_heads=4",
            "head=hydra_pp",
            "data.batch_size=16",
            f"data.max_length={longest}",
            f"data.prepared={tiny_prepared}",
            f"out={tmp_path}",
        ]
    )
    assert 0.75 <= ratio <= 1.25, ratio


@pytest.mark.slow
def test_estimate_within_25_percent_of_measured_peak_smollm2(smol_prepared, tmp_path):
    data = smol_prepared  # bundled ShareGPT prepared at 512 tokens, as the recipe trains it
    ratio = _measured_vs_estimated(
        [*COMMON, "experiment=smollm2_cpu", f"data.prepared={data}", f"out={tmp_path / 'run'}"]
    )
    assert 0.75 <= ratio <= 1.25, ratio


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gemma2", "phi3", "qwen2"])
def test_parameter_count_of_other_families(family, tmp_path):
    """The plan's base parameters from a model directory's config equal the model's own count
    (within the biases and q/k norms it leaves out): MoE experts and routers, tied embeddings,
    head_dim other than hidden / heads, fused projections."""
    import transformers

    from tests.families import save_family
    from train.plan import base_params

    model_dir = save_family(family, tmp_path / family)
    cfg = train_config(["base=pretrained", f"base.path={model_dir}", "data.prepared=/p", "out=/x"])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    have = sum(p.numel() for p in model.parameters())
    assert base_params(base_arch(cfg.base))[0] == pytest.approx(have, rel=0.01)


@pytest.mark.parametrize(
    ("preset", "published"),
    [  # total parameters from each model card
        ("qwen2_5_7b", 7.62e9),
        ("qwen3_8b", 8.19e9),
        ("qwen3_30b_a3b", 30.5e9),
        ("mistral_7b", 7.25e9),
        ("mixtral_8x7b", 46.7e9),
        ("gemma2_9b", 9.24e9),
        ("phi3_mini", 3.82e9),
    ],
)
def test_family_presets_plan_with_their_published_size(preset, published):
    cfg = train_config([f"base={preset}", "data.prepared=/p", "out=/x", "data.max_length=2048"])
    assert base_params(base_arch(cfg.base))[0] == pytest.approx(published, rel=0.005)
    assert estimate(cfg, base_arch(cfg.base))["total"] > 0
