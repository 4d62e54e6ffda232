"""Every YAML in conf/ composes and validates; bad values fail early, naming key and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from tests.helpers import group_options, prep_config
from train.core.config import compose, conf_dir
from train.core.config import load as to_typed
from train.core.errors import ConfigError

PRIMARY = {
    "prep": "launch.commands.prep",
    "train": "launch.commands.train",
    "eval": "launch.commands.eval",
    "launch": "launch.commands.launch",
    "plan": "launch.commands.plan",
    "report": "launch.commands.report",
    "sweep": "launch.commands.sweep",
    "export": "launch.commands.export",
    "import": "launch.commands.import_heads",
}
# Which subcommand composes each config group (the first one listed is used in the test).
USERS = {
    "base": ["prep", "train", "eval"],
    "data": ["prep"],
    "head": ["train"],
    "trainer": ["train"],
    "logger": ["train"],
    "experiment": ["train"],
    "tree": ["eval"],
    "launcher": ["launch"],
    "sweep": ["sweep"],
}
# conf/deepspeed/ holds DeepSpeed's own JSON configs (referenced by the trainer configs), not
# a config group.
GROUPS = sorted(p.name for p in conf_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def test_every_primary_config_is_a_subcommand():
    from launch.cli import SUBCOMMANDS

    primaries = {p.stem for p in conf_dir().glob("*.yaml")} - {"common"}
    assert primaries == set(PRIMARY) == set(SUBCOMMANDS)


def test_every_group_is_used():
    assert set(GROUPS) == set(USERS)


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes_and_validates(group):
    from evaluation.config import EvalConfig
    from train.config import TrainConfig

    options = group_options(group)
    assert options, f"conf/{group} is empty"
    for option in options:
        for primary in USERS[group]:
            overrides = [f"{group}={option}", "out=/tmp/x"]
            text = (conf_dir() / group / f"{option}.yaml").read_text()
            if group == "data" and "path: ???" in text:
                overrides.append(f"data.path={Path(__file__)}")
            if group == "data" and "sources: ???" in text:
                overrides.append(f"data.sources=[{{path: {Path(__file__)}, weight: 1}}]")
            if group == "base" and "path: ???" in text:
                overrides.append("base.path=/tmp/model")
            if group == "tree" and "path: ???" in text:
                overrides.append("tree.path=/tmp/tree.json")
            if primary == "train":
                overrides.append("data.prepared=/tmp/p")
                cfg = to_typed(compose("train", overrides), TrainConfig)
            elif primary == "launch":
                overrides.append("data.prepared=/tmp/p")
                cfg = compose("launch", overrides)
                assert cfg.launcher.name == option
                continue
            elif primary == "eval":
                cfg = to_typed(compose("eval", [*overrides, "heads=/tmp/h"]), EvalConfig)
            elif primary == "sweep":
                from launch.config import SweepConfig
                from launch.sweep_state import plan_points

                cfg = to_typed(compose("sweep", overrides), SweepConfig)
                assert cfg.sweep.name == option and plan_points(cfg.sweep)
                # every point's train overrides compose into a valid train config
                for pt in plan_points(cfg.sweep):
                    train = [*cfg.sweep.train, *pt["train_overrides"], "out=/tmp/x"]
                    to_typed(compose("train", [*train, "data.prepared=/tmp/p"]), TrainConfig)
                if cfg.sweep.search is not None:  # so do a search's draws from its space
                    import optuna

                    from launch.search import suggest

                    optuna.logging.set_verbosity(optuna.logging.WARNING)
                    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
                    for _ in range(6):
                        draw = suggest(study.ask(), cfg.sweep.search.space)
                        train = [*cfg.sweep.train, *draw, "out=/tmp/x", "data.prepared=/tmp/p"]
                        to_typed(compose("train", train), TrainConfig)
                continue
            else:
                cfg = prep_config(overrides)
            if group == "experiment":
                continue  # overrides only: composing and validating above is the check
            value = getattr(cfg, group)
            if group in ("base", "data", "head"):
                assert value.name == option
            elif group == "tree":
                assert value.kind in option or value.name == option
            elif group == "logger" and option == "none":
                assert value is None
            else:
                assert value["_target_"].startswith("lightning.pytorch.")


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("data.max_length=-5", "data.max_length", ">= 16"),
        ("data.loss_roles=[assistant,narrator]", "data.loss_roles", "system, user, assistant"),
        ("data.max_length=abc", "data.max_length", "integer"),
        ("data.val_fraction=1.5", "data.val_fraction", "[0, 1)"),
        ("data.long_conversations=chop", "data.long_conversations", "'split', 'truncate'"),
        ("regen.temperature=-1", "regen.temperature", ">= 0"),
        ("regen.weight_layout=fast", "regen.weight_layout", "'packed', 'standard'"),
        ("base.dtype=fp8", "base.dtype", "'float32'"),
        ("num_proc=0", "num_proc", "positive"),
        ("data.roles={bot: robot}", "data.roles.bot", "system, user, assistant"),
        ("overwrite=maybe", "overwrite", "true or false"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, key, fix):
    with pytest.raises(ConfigError) as e:
        prep_config(["out=/tmp/x", override])
    msg = str(e.value)
    assert f"'{key}'" in msg and fix in msg, msg


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("head.num_heads=0", "head.num_heads", "[1, 16]"),
        ("head.loss.temperature=0", "head.loss.temperature", "> 0"),
        ("head.loss.head_weighting=linear", "head.loss.head_weighting", "'constant'"),
        ("head.loss.kind=wasserstein", "head.loss.kind", "'reverse_kl'"),
        ("head.loss.kind=mix", "head.loss.mix", "{kl: 0.5, lk: 0.5}"),
        ("head.loss.mix={kl: 1.0}", "head.loss.mix", "set it to null"),
        ("head.loss.kind=mix|head.loss.mix={kl: 1.0, emd: 1.0}", "head.loss.mix", "'emd'"),
        ("head.loss.kind=mix|head.loss.mix={kl: 0.0}", "head.loss.mix", "not all 0"),
        ("optim.lr=-1", "optim.lr", "> 0"),
        ("data.batch_size=0", "data.batch_size", "positive"),
        ("trainer.max_steps=-1", "trainer.max_steps", "positive integer"),
        ("checkpoint_every=0", "checkpoint_every", "positive"),
    ],
)
def test_bad_train_values_name_the_key(override, key, fix):
    from train.config import TrainConfig

    with pytest.raises(ConfigError) as e:
        overrides = ["out=/tmp/x", "data.prepared=/tmp/p", *override.split("|")]
        to_typed(compose("train", overrides), TrainConfig)
    msg = str(e.value)
    assert f"'{key}'" in msg and fix in msg, msg


def test_missing_required_value_names_the_key():
    with pytest.raises(ConfigError, match=r"'out' is required.*out=VALUE"):
        prep_config([])
    with pytest.raises(ConfigError, match=r"'data.path' is required"):
        prep_config(["out=/tmp/x", "data=sharegpt"])


def test_unknown_group_option_and_unknown_key_fail_in_hydra():
    with pytest.raises(ConfigCompositionException, match="smollm2_135m"):
        compose("prep", ["base=no_such_model", "out=x"])  # lists the available options
    with pytest.raises(ConfigCompositionException, match="max_lenght"):
        compose("prep", ["data.max_lenght=5", "out=x"])


def test_unknown_key_added_with_plus_is_rejected_by_validation():
    with pytest.raises(ConfigError, match="unknown key; known keys are"):
        prep_config(["out=x", "+data.colour=red"])


def test_struct_mode_blocks_typos_on_plain_access():
    cfg = compose("prep", ["out=x"])
    with pytest.raises((ConfigKeyError, ConfigAttributeError)):
        _ = cfg.data.max_lenght


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("tree.budget=0", "tree.budget", "positive"),
        ("tree=branching", None, None),
        ("tree.kind=preset", "tree.name", "needs tree.name"),
        ("eval.temperature=-1", "eval.temperature", ">= 0"),
        ("eval.acceptance=typical", "eval.acceptance", "greedy at temperature 0"),
        ("eval.max_new_tokens=0", "eval.max_new_tokens", "positive"),
    ],
)
def test_bad_eval_values_name_the_key(override, key, fix):
    from evaluation.config import EvalConfig

    overrides = ["out=/tmp/x", "heads=/tmp/h", override]
    if key is None:  # a valid override: composes and validates
        assert to_typed(compose("eval", overrides), EvalConfig).tree.branching == [3, 2, 2]
        return
    with pytest.raises(ConfigError) as e:
        to_typed(compose("eval", overrides), EvalConfig)
    msg = str(e.value)
    assert f"'{key}'" in msg and fix in msg, msg


def test_eval_defaults_follow_temperature():
    from evaluation.config import EvalConfig

    base = ["out=/tmp/x", "heads=/tmp/h"]
    greedy = to_typed(compose("eval", base), EvalConfig).eval
    assert greedy.acceptance == "greedy" and greedy.check_lossless is True
    hot = to_typed(compose("eval", [*base, "eval.temperature=0.7"]), EvalConfig).eval
    assert hot.acceptance == "rejection" and hot.check_lossless is False
    with pytest.raises(ConfigError, match="check_lossless"):
        to_typed(
            compose("eval", [*base, "eval.temperature=0.7", "eval.check_lossless=true"]),
            EvalConfig,
        )


def test_deepspeed_configs_are_valid_json_and_resolve():
    import json

    from omegaconf import OmegaConf

    for name in ("zero2", "zero3", "zero3_offload"):
        ds = json.loads((conf_dir() / "deepspeed" / f"{name}.json").read_text())
        assert ds["zero_optimization"]["stage"] == (2 if name == "zero2" else 3)
        cfg = compose("train", [f"trainer=deepspeed_{name}", "out=/x", "data.prepared=/p"])
        resolved = OmegaConf.to_container(cfg.trainer, resolve=True)
        assert Path(resolved["strategy"]["config"]).is_file(), resolved["strategy"]
        assert resolved["strategy"]["micro_batch_size"] == cfg.data.batch_size


@pytest.mark.parametrize("trainer", group_options("trainer"))
def test_every_trainer_strategy_instantiates(trainer):
    """Each trainer config validates (every key an argument of its _target_) and its strategy
    builds: DeepSpeed / DDP / FSDP objects as configured, Lightning's own single-device
    strategy where none is set (the whole Trainer is built; a GPU config on a machine without
    one is built on the CPU, the rest of its keys as written)."""
    import torch
    from hydra.utils import instantiate

    from train.config import TrainConfig

    cfg = to_typed(
        compose("train", [f"trainer={trainer}", "out=/x", "data.prepared=/p"]), TrainConfig
    )
    strategy = cfg.trainer.get("strategy")
    if strategy is not None:
        obj = instantiate(strategy)
        assert type(obj).__name__.endswith("Strategy"), type(obj)
        assert type(obj).__module__.split(".")[0] in ("lightning", "train"), type(obj)
        # built as configured: each kind's keys reach the object
        name = type(obj).__name__
        if name == "DDPStrategy":
            assert obj.process_group_backend == strategy["process_group_backend"]
            assert obj._ddp_kwargs["find_unused_parameters"] is False
        elif name == "FSDPStrategy":
            assert obj.sharding_strategy.name == strategy["sharding_strategy"]
        else:  # DeepSpeed: the JSON config it names, its ZeRO stage and the heads-only saves
            stage = json.loads(Path(strategy["config"]).read_text())["zero_optimization"]
            assert obj.config["zero_optimization"]["stage"] == stage["stage"] > 0
            assert obj.exclude_frozen_parameters is True
        return
    kw = dict(cfg.trainer)
    if kw["accelerator"] == "gpu" and not torch.cuda.is_available():
        kw.update(accelerator="cpu", precision="32-true")
    t = instantiate(kw, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert type(t.strategy).__name__ == "SingleDeviceStrategy" and t.max_steps == kw["max_steps"]


def test_unions_trainer_keys_and_missing_keys_are_named():
    from train.config import TrainConfig

    base = ["out=/tmp/x", "data.prepared=/tmp/p"]
    with pytest.raises(
        ConfigError, match=r"'resume' = 'maybe' is invalid: expected true/false or 'auto'"
    ):
        to_typed(compose("train", [*base, "resume=maybe"]), TrainConfig)
    # Trainer and logger are _target_ configs: each key must be an argument of the target
    with pytest.raises(ConfigError, match=r"'trainer.max_step' = 5 .*did you mean 'max_steps'"):
        to_typed(compose("train", [*base, "+trainer.max_step=5"]), TrainConfig)
    with pytest.raises(ConfigError, match=r"'logger.sav_dir'.*CSVLogger; did you mean 'save_dir'"):
        to_typed(compose("train", [*base, "+logger.sav_dir=x"]), TrainConfig)
    # every missing key at once, not the first interpolation that needs one
    with pytest.raises(ConfigError, match=r"keys 'data.prepared', 'out' are required") as e:
        to_typed(compose("train", []), TrainConfig, "hydra-heads train data.prepared=D out=O")
    assert "e.g. hydra-heads train data.prepared=D out=O" in str(e.value)


# The README's rule: a schema names keys, conf/ holds their values. These optional keys are
# the exceptions it lists (inline list items, sweep files, older heads records).
OPTIONAL_KEYS = {
    "SourceConfig": {"format", "name", "max_conversations"},  # a mixture's sources
    "SearchParam": {"choices", "low", "high", "integer", "log"},  # a search's parameters
    "SweepSpec": {"extra", "search"},  # a sweep file's
    "TinyConfig": {"vocab_size"},  # older heads records have none
}


def test_config_schemas_hold_no_defaults_but_the_listed_ones():
    import importlib

    from train.core.config import ConfigModel

    packages = ("train", "evaluation", "data_prep", "launch")
    for module in (*(f"{p}.config" for p in packages), "train.heads.config"):
        importlib.import_module(module)

    def subclasses(c):
        for sub in c.__subclasses__():
            yield sub
            yield from subclasses(sub)

    found = {}
    for model in set(subclasses(ConfigModel)):
        if model.__module__.split(".")[0] not in packages:
            continue  # a test's own schema
        optional = {n for n, f in model.model_fields.items() if not f.is_required()}
        if optional:
            found[model.__name__] = optional
    assert found == OPTIONAL_KEYS, "a default belongs in conf/, not in the schema"
