"""Heads checkpoints describe themselves: written in full, older formats migrated by fixed
constants, newer and damaged files refused with one clear error, and loading composes no config
(neither hydra-core nor omegaconf is imported)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, head_config, run_here
from train.core.base import BaseConfig, TinyConfig, recorded_base
from train.core.checkpoint import (
    CONFIG_FILE,
    FORMAT,
    HEADS_FILE,
    VERSION,
    CheckpointError,
    FormatTooNewError,
    migrate,
)
from train.core.errors import ConfigError, UserError
from train.heads import (
    HeadConfig,
    LossConfig,
    base_shape,
    build_heads,
    heads_meta,
    load_heads,
    save_heads,
)


def _saved(tmp_path: Path, tiny_base, name: str = "hydra", **head) -> Path:
    # the structure of the formats migrated from (bias and tie_blocks came later, false)
    head = {"bias": False, "tie_blocks": False, **head}
    heads = build_heads(
        head_config(name, num_heads=2, **head),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
    )
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return save_heads(
        tmp_path / name, heads, heads_meta(heads, tiny_base.fingerprint(), tiny_base.cfg)
    )


def _edit_meta(d: Path, edit) -> None:
    meta = json.loads((d / CONFIG_FILE).read_text())
    edit(meta)
    (d / CONFIG_FILE).write_text(json.dumps(meta))


def test_a_saved_checkpoint_records_every_head_and_base_key(tmp_path, tiny_base):
    d = _saved(tmp_path, tiny_base, "hydra_pp")
    meta = json.loads((d / CONFIG_FILE).read_text())
    assert meta["format"] == FORMAT == "hydra-heads/5"
    assert set(meta["head"]) == set(HeadConfig.model_fields)
    assert set(meta["head"]["loss"]) == set(LossConfig.model_fields)
    cfg = meta["base"]["config"]
    assert set(cfg) == set(BaseConfig.model_fields)
    assert set(cfg["tiny"]) == set(TinyConfig.model_fields)
    assert recorded_base(cfg) == tiny_base.cfg


def test_a_partial_base_config_is_refused_at_save_time(tiny_base):
    heads = build_heads(
        head_config("medusa", num_heads=1), base_shape(tiny_base.config), tiny_base.lm_head.weight
    )
    with pytest.raises(ConfigError, match="base.source"):
        heads_meta(heads, tiny_base.fingerprint(), {"name": "tiny"})


@pytest.mark.parametrize("name", ["medusa", "hydra", "hydra_pp"])
def test_v1_checkpoint_missing_keys_migrates_and_loads(tmp_path, tiny_base, name):
    """A hydra-heads/1 file whose head and base configs predate keys added since: the keys
    get the values that version trained with, and the heads compute what they did."""
    d = _saved(tmp_path, tiny_base, name)

    def to_v1(meta):
        meta["format"] = "hydra-heads/1"
        for key in ("aux_layers", "bias", "tie_blocks", "init", "dropout", "noise_alpha"):
            del meta["head"][key]
        for key in ("head_weighting", "chunk_size", "head_decay"):
            del meta["head"]["loss"][key]
        cfg = meta["base"]["config"]
        for key in ("arch", "cache", "revision"):
            del cfg[key]
        del cfg["tiny"]["vocab_size"], cfg["tiny"]["max_position_embeddings"]

    original, _ = load_heads(d, tiny_base.fingerprint())
    _edit_meta(d, to_v1)
    loaded, meta = load_heads(d, tiny_base.fingerprint())
    assert meta["format"] == FORMAT
    head = meta["head"]
    assert (head["bias"], head["tie_blocks"], head["init"], head["dropout"]) == (
        False,
        False,
        "ours",
        0.0,
    )
    want = "geometric" if name == "medusa" else "constant"
    assert head["loss"]["head_weighting"] == want and head["loss"]["chunk_size"] == 1024
    assert recorded_base(meta["base"]["config"]) == tiny_base.cfg
    x, e = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    for a, b in zip(original(x, e), loaded(x, e), strict=True):
        assert torch.equal(a, b)


def test_migrate_fills_each_arch_with_its_v1_values_and_leaves_its_input_alone():
    for arch, layers, lm, distill, weighting in [
        ("medusa", 1, 1.0, 0.0, "geometric"),
        ("hydra", 1, 1.0, 0.0, "constant"),
        ("hydra_pp", 4, 0.0, 1.0, "constant"),
    ]:
        v1 = {"format": "hydra-heads/1", "arch": arch, "head": {"name": arch, "num_heads": 3}}
        meta = migrate(v1)
        assert v1["head"] == {"name": arch, "num_heads": 3} and v1["format"] == "hydra-heads/1"
        cfg = HeadConfig(**meta["head"])
        assert (cfg.num_heads, cfg.num_layers, cfg.loss.head_weighting) == (3, layers, weighting)
        assert (cfg.loss.lm_weight, cfg.loss.distill_weight) == (lm, distill)
        assert (cfg.loss.kind, cfg.loss.mix) == ("kl", None)  # through format 2 to 3
    assert migrate({"format": FORMAT, "x": 1}) == {"format": FORMAT, "x": 1}


def test_v2_checkpoint_gets_forward_kl_and_loads(tmp_path, tiny_base):
    """Format 2 predates head.loss.kind: its heads were distilled with forward KL."""
    loss = {**head_config("hydra_pp").loss.model_dump(), "kind": "lk"}
    d = _saved(tmp_path, tiny_base, "hydra_pp", loss=loss)

    def to_v2(meta):
        meta["format"] = "hydra-heads/2"
        del meta["head"]["loss"]["kind"], meta["head"]["loss"]["mix"], meta["head"]["aux_layers"]

    original, _ = load_heads(d, tiny_base.fingerprint())
    assert original.cfg.loss.kind == "lk"
    _edit_meta(d, to_v2)
    loaded, meta = load_heads(d, tiny_base.fingerprint())
    assert meta["format"] == FORMAT and loaded.cfg.loss.kind == "kl"
    x, e = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    for a, b in zip(original(x, e), loaded(x, e), strict=True):
        assert torch.equal(a, b)


# (format, the head key it lacked, that key's value for every head of it)
LATER_KEYS = [
    (3, "aux_layers", None),  # EAGLE-3's fused layers: no head of format 3 fused any
    (4, "freeze_lm_heads", False),  # every head of format 4 trained its lm heads
]


@pytest.mark.parametrize(("version", "key", "value"), LATER_KEYS)
def test_a_checkpoint_from_before_a_key_gets_its_old_value_and_loads(
    tmp_path, tiny_base, version, key, value
):
    d = _saved(tmp_path, tiny_base, "hydra_pp")
    original, _ = load_heads(d, tiny_base.fingerprint())
    _edit_meta(d, lambda m: (m.update(format=f"hydra-heads/{version}"), m["head"].pop(key)))
    loaded, meta = load_heads(d, tiny_base.fingerprint())
    assert meta["format"] == FORMAT and meta["head"][key] == value
    assert all(lm.weight.requires_grad for lm in loaded.lm_heads)
    x, e = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    for a, b in zip(original(x, e), loaded(x, e), strict=True):
        assert torch.equal(a, b)


def test_a_future_format_names_the_file_the_format_and_the_fix(tmp_path, tiny_base):
    d = _saved(tmp_path, tiny_base)
    newer = f"hydra-heads/{VERSION + 1}"  # the next format, whatever the current one is
    _edit_meta(d, lambda m: m.update(format=newer))
    with pytest.raises(FormatTooNewError) as e:
        load_heads(d)
    msg = str(e.value)
    assert str(d / CONFIG_FILE) in msg and f"'{newer}'" in msg and "upgrade hydra-heads" in msg
    _edit_meta(d, lambda m: m.update(format="other-tool/1"))
    with pytest.raises(CheckpointError, match="not a hydra-heads heads checkpoint"):
        load_heads(d)


def test_a_truncated_weights_file_is_a_user_error(tmp_path, tiny_base):
    d = _saved(tmp_path, tiny_base)
    data = (d / HEADS_FILE).read_bytes()
    (d / HEADS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_heads(d, tiny_base.fingerprint())
    msg = str(e.value)
    assert isinstance(e.value, UserError)
    assert str(d / HEADS_FILE) in msg and "truncated or corrupt" in msg and "retrain" in msg
    (d / HEADS_FILE).write_bytes(b"")  # empty: what a full disk leaves
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_heads(d)


def test_weights_of_other_heads_are_a_user_error(tmp_path, tiny_base):
    a, b = _saved(tmp_path, tiny_base, "hydra"), _saved(tmp_path, tiny_base, "medusa")
    (a / HEADS_FILE).write_bytes((b / HEADS_FILE).read_bytes())
    with pytest.raises(CheckpointError, match="do not belong together"):
        load_heads(a)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"format": "hydra-heads/2", "arch": ', "is not valid JSON"),
        ("[1, 2]", "not an object"),
        ('{"format": "hydra-heads/2", "arch": "hydra"}', "lacks or has a malformed 'head'"),
    ],
)
def test_a_damaged_config_file_is_a_user_error(tmp_path, tiny_base, text, match):
    d = _saved(tmp_path, tiny_base)
    (d / CONFIG_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=match) as e:
        load_heads(d)
    assert str(d / CONFIG_FILE) in str(e.value)


def test_a_v2_head_config_missing_a_key_names_it_and_the_file(tmp_path, tiny_base):
    d = _saved(tmp_path, tiny_base)
    _edit_meta(d, lambda m: m["head"].pop("bias"))
    with pytest.raises(CheckpointError) as e:
        load_heads(d)
    assert "head.bias" in str(e.value) and str(d / CONFIG_FILE) in str(e.value)


def test_cli_export_and_eval_of_a_truncated_checkpoint_exit_2_with_one_message(tmp_path, tiny_base):
    d = _saved(tmp_path, tiny_base, "hydra_pp")
    data = (d / HEADS_FILE).read_bytes()
    (d / HEADS_FILE).write_bytes(data[:100])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    for args in (
        ["export", f"heads={d}", "format=hydra", f"out={tmp_path / 'x'}"],
        [
            "eval",
            f"heads={d}",
            "base=tiny_random",
            f"eval.prompts={prompts}",
            f"out={tmp_path / 'e'}",
        ],
    ):
        r = run_here(*args)
        assert r.returncode == 2, r.stderr[-2000:]
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and str(d / HEADS_FILE) in errors[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
        assert not (tmp_path / "x").exists()


def test_an_hf_export_of_format_1_imports_and_a_truncated_one_is_refused(tmp_path, tiny_base):
    from train.export import export_heads, import_heads
    from train.export.common import FormatError

    d = _saved(tmp_path, tiny_base, "medusa")
    export_heads(d, "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["format"] = "hydra-heads/1"
    del config["head"]["tie_blocks"], config["head"]["loss"]["head_weighting"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    import_heads(tmp_path / "hf", "hf", None, tmp_path / "back")
    back, meta = load_heads(tmp_path / "back", tiny_base.fingerprint())
    assert meta["format"] == FORMAT and back.cfg.loss.head_weighting == "geometric"
    weights = tmp_path / "hf" / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()  # a hard link to heads.safetensors: cut a copy, not the checkpoint
    weights.write_bytes(data[:64])
    with pytest.raises(FormatError, match="truncated or corrupt") as e:
        import_heads(tmp_path / "hf", "hf", None, tmp_path / "again")
    assert str(weights) in str(e.value)


# Run in a fresh interpreter: build, save and load heads of every arch, rebuild the recorded
# base config, migrate and load a v1 file; then neither hydra nor omegaconf may be imported.
FRESH = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch

    from train.core.base import recorded_base
    from train.heads import HeadConfig, build_heads, heads_meta, load_heads, save_heads

    root = Path(sys.argv[1])
    spec = json.loads(sys.argv[2])
    shape, fp, base_cfg = spec["shape"], spec["fingerprint"], spec["base"]
    weight = torch.randn(shape["vocab_size"], shape["hidden_size"])
    for name, head in spec["heads"].items():
        heads = build_heads(HeadConfig(**head), shape, weight)
        d = save_heads(root / name, heads, heads_meta(heads, fp, base_cfg))
        loaded, meta = load_heads(d, fp)
        assert loaded.arch == name
        assert recorded_base(meta["base"]["config"]).to_dict() == base_cfg
        old = json.loads((d / "heads_config.json").read_text())
        old["format"] = "hydra-heads/1"
        for key in ("bias", "tie_blocks", "init"):
            del old["head"][key]
        del old["base"]["config"]["arch"]
        (d / "heads_config.json").write_text(json.dumps(old))
        loaded, meta = load_heads(d, fp)
        recorded_base(meta["base"]["config"])
    bad = sorted(m for m in sys.modules if m.split(".")[0] in ("hydra", "omegaconf"))
    assert not bad, bad
    print("clean")
    """
)


def test_loading_heads_and_their_base_config_imports_no_hydra_or_omegaconf(tmp_path, tiny_base):
    spec = {
        "shape": base_shape(tiny_base.config),
        "fingerprint": tiny_base.fingerprint(),
        "base": tiny_base.cfg.to_dict(),
        "heads": {
            # bias / tie_blocks false: the script rewrites the files as format 1, without them
            n: head_config(n, num_heads=2, bias=False, tie_blocks=False).to_dict()
            for n in ("medusa", "hydra", "hydra_pp")
        },
    }
    r = subprocess.run(
        [sys.executable, "-c", FRESH, str(tmp_path), json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0 and "clean" in r.stdout, r.stderr[-3000:]
