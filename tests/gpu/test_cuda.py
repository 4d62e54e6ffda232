"""On CUDA (`pytest -m gpu`; skipped without it): a bf16-mixed training step, lossless tree
verification (and the same tokens as on CPU), and the memory plan against the measured peak."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, make_heads, oracle_decode, train_config
from train.decoding.decoder import Decoder
from train.decoding.tree import PRESETS, Tree, branching
from train.heads import HEADS

pytestmark = pytest.mark.gpu

PROMPTS = ["hello there, how are you?", "count: 1 2 3 4", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture
def fp32_matmul():
    """Full fp32 matmuls (no TF32) for the CPU/GPU token comparisons, restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


# -- training: one bf16-mixed step on CUDA --------------------------------------------------------
@pytest.mark.parametrize("name", sorted(HEADS))
def test_bf16_mixed_training_steps_on_cuda(tiny_prepared, tmp_path, name):
    import lightning.pytorch as pl

    from train.recipe import build_module

    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16")
    steps = 3
    cfg = train_config(
        [
            "base=tiny_random",
            f"head={name}",
            "trainer=gpu",
            f"trainer.max_steps={steps}",
            f"data.prepared={tiny_prepared}",
            f"out={tmp_path / 'run'}",
            "logger=none",
            "data.batch_size=4",
            "optim.warmup_steps=1",
        ]
    )
    assert (cfg.trainer["accelerator"], cfg.trainer["precision"]) == ("gpu", "bf16-mixed")
    module, dm, *_ = build_module(cfg)
    base_before = {k: v.detach().clone() for k, v in module.base_model.state_dict().items()}
    heads_before = {k: v.detach().clone() for k, v in module.heads.state_dict().items()}

    seen: list[tuple] = []  # (device, autocast on, autocast dtype) at each heads forward
    losses: list[float] = []

    def pre_hook(mod, args):
        dev = next(mod.parameters()).device
        seen.append((dev.type, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))

    module.heads.register_forward_pre_hook(pre_hook)

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(
        accelerator=cfg.trainer["accelerator"],
        devices=1,
        precision=cfg.trainer["precision"],
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[Losses()],
    )
    trainer.fit(module, datamodule=dm)

    assert trainer.global_step == steps
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    assert seen and all(s == ("cuda", True, torch.bfloat16) for s in seen), seen
    heads_after = module.heads.state_dict()
    # bf16-mixed keeps fp32 master weights; the optimizer changed the trainable ones
    assert all(p.dtype == torch.float32 for p in module.heads.parameters())
    trainable = {k for k, p in module.heads.named_parameters() if p.requires_grad}
    changed = {k for k in trainable if not torch.equal(heads_before[k], heads_after[k].cpu())}
    assert changed == trainable, sorted(trainable - changed)
    base_after = module.base_model.state_dict()
    assert next(module.base_model.parameters()).device.type == "cuda"
    assert all(torch.equal(base_before[k], base_after[k].cpu()) for k in base_before)


# -- decoding: tree verification on CUDA ----------------------------------------------------------
def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("arch", sorted(HEADS))
@pytest.mark.parametrize("draft", [None, 64])
def test_tree_speculative_greedy_on_cuda_equals_plain_and_cpu(tiny_base, fp32_matmul, arch, draft):
    cpu_model = tiny_base.model
    gpu_model = copy.deepcopy(cpu_model).to("cuda")  # the session's CPU model stays as it is
    heads = make_heads(cpu_model, arch, seed=1, scale=0.01, draft=draft)
    gpu_heads = copy.deepcopy(heads).to("cuda")
    for paths in (PRESETS["mc_sim_7b_63"], branching([3, 2, 2])):
        tree = Tree.from_paths(paths)
        gpu = Decoder(gpu_model, set(), gpu_heads, tree)
        cpu = Decoder(cpu_model, set(), heads, tree)
        assert gpu.device.type == "cuda" and cpu.device.type == "cpu"
        for prompt in PROMPTS:
            ids = _encode(tiny_base.tokenizer, prompt)
            plain, spec = gpu.plain([ids], 40)[0], gpu.speculative([ids], 40)[0]
            assert spec.tokens == plain.tokens, (arch, draft, prompt)
            assert len(spec.tokens) == 40 and spec.finish == "length"
            assert spec.steps == len(spec.accepted) and spec.tau >= 1.0
            assert spec.tokens == cpu.speculative([ids], 40)[0].tokens, (arch, draft, prompt)


@pytest.mark.parametrize("true_path", [[0, 0, 0], [2, 1, 0]])
def test_oracle_heads_accept_whole_paths_on_cuda(tiny_base, fp32_matmul, true_path):
    """Random heads rarely get a draft accepted; an oracle proposal makes every step accept a
    whole path through non-zero ranks, so the KV-cache compaction on CUDA moves entries."""
    model = copy.deepcopy(tiny_base.model).to("cuda")
    heads = make_heads(tiny_base.model, "hydra_pp", 0, 0.1).to("cuda")
    ref, gen = oracle_decode(model, heads, _encode(tiny_base.tokenizer, PROMPTS[1]), true_path)
    assert gen.tokens == ref
    assert gen.accepted[:-1] == [3] * (len(gen.accepted) - 1)
    assert gen.tau > 3.5


# -- the memory plan against a measured CUDA peak -------------------------------------------------
MEASURE = """
import json, sys
import lightning.pytorch as pl
import torch
from tests.helpers import train_config
from train.plan import base_arch, estimate
from train.recipe import fit

cfg = train_config(sys.argv[1:])
est = estimate(cfg, base_arch(cfg.base))
t = {k: v for k, v in cfg.trainer.items() if k != "_target_"}
start = torch.cuda.memory_allocated()  # 0: nothing is on the GPU before the fit moves it there
torch.cuda.reset_peak_memory_stats()
fit(cfg, lambda **kw: pl.Trainer(**{**t, **kw, "enable_progress_bar": False}), False)
print(json.dumps({
    "setup": est["setup"],
    "tensors": est["total"],
    "overhead": est["runtime_overhead"],
    "peak_allocated": torch.cuda.max_memory_allocated() - start,
    "peak_reserved": torch.cuda.max_memory_reserved(),
}))
"""

# The shape of tests/train/test_plan.py's tiny CPU check (hidden 512, 4 layers, Hydra++, batch 16
# x 128): ~0.5 GB of tensors, so the fixed cuBLAS workspaces (tens of MB, allocated through the
# caching allocator) stay well inside the tolerance.
TINY = [
    "logger=none",
    "trainer=gpu",
    "trainer.max_steps=3",
    "final_validation=false",
    "trainer.val_check_interval=1000",
    "base=tiny_random",
    "base.tiny.hidden_size=512",
    "base.tiny.intermediate_size=1536",
    "base.tiny.num_hidden_layers=4",
    "base.tiny.num_attention_heads=8",
    "base.tiny.num_key_value_heads=4",
    "head=hydra_pp",
    "data.batch_size=16",
    "data.max_length=128",
]


def test_plan_estimate_within_25_percent_of_measured_cuda_peak(tiny_prepared, tmp_path):
    """Like with like: the plan's tensor rows (`total`: weights, grads, AdamW states,
    activations, loss chunks) against `torch.cuda.max_memory_allocated()` over a real 3-step
    bf16-mixed fit, both counting tensors only. The plan's fixed `runtime_overhead` row (CUDA
    context + allocator slack) is not in the allocated figure; it is checked separately: the
    allocator's peak reservation fits in tensors + overhead.

    In a fresh process, as the CPU check: one that already ran CUDA work would have its cuBLAS
    workspaces allocated before the measurement starts."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16")
    overrides = [*TINY, f"data.prepared={tiny_prepared}", f"out={tmp_path / 'run'}"]
    r = subprocess.run(
        [sys.executable, "-c", MEASURE, *overrides],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["setup"]["device"] == "gpu" and res["setup"]["act_bytes"] == 2  # bf16 autocast
    ratio = res["tensors"] / res["peak_allocated"]
    assert 0.75 <= ratio <= 1.25, res
    assert res["peak_reserved"] <= res["tensors"] + res["overhead"], res
