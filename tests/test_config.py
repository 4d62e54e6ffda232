"""Every YAML in conf/ composes and validates; bad values fail early, naming key and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from launch.app import conf_dir
from tests.conftest import compose, prep_config
from train.config import ConfigError

PRIMARY = {"prep": "launch.commands.prep"}
GROUPS = sorted(p.name for p in conf_dir().iterdir() if p.is_dir())


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def test_every_primary_config_is_a_subcommand():
    from launch.cli import SUBCOMMANDS

    primaries = {p.stem for p in conf_dir().glob("*.yaml")} - {"common"}
    assert primaries == set(PRIMARY) == set(SUBCOMMANDS)


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_option_composes_and_validates(group):
    options = _options(group)
    assert options, f"conf/{group} is empty"
    for option in options:
        overrides = [f"{group}={option}", "out=/tmp/x"]
        if group == "data" and "path: ???" in (conf_dir() / group / f"{option}.yaml").read_text():
            overrides.append(f"data.path={Path(__file__)}")
        cfg = prep_config(overrides)
        assert getattr(cfg, group).name == option


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("data.max_length=-5", "data.max_length", ">= 16"),
        ("data.loss_roles=[assistant,narrator]", "data.loss_roles", "system, user, assistant"),
        ("data.max_length=abc", "data.max_length", "integer"),
        ("data.val_fraction=1.5", "data.val_fraction", "[0, 1)"),
        ("data.long_conversations=chop", "data.long_conversations", "'split', 'truncate'"),
        ("regen.temperature=-1", "regen.temperature", ">= 0"),
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


def test_missing_required_value_names_the_key():
    with pytest.raises(ConfigError, match=r"'out' is required.*out=VALUE"):
        prep_config([])
    with pytest.raises(ConfigError, match=r"'data.path' is required"):
        prep_config(["out=/tmp/x", "data=sharegpt"])


def test_unknown_group_option_and_unknown_key_fail_in_hydra():
    with pytest.raises(ConfigCompositionException, match="smollm2_135m"):
        compose("prep", ["base=no_such_model", "out=x"])  # lists the available options
    with pytest.raises(ConfigCompositionException):
        compose("prep", ["data.max_lenght=5", "out=x"])


def test_unknown_key_added_with_plus_is_rejected_by_validation():
    with pytest.raises(ConfigError, match="unknown key; known keys are"):
        prep_config(["out=x", "+data.colour=red"])


def test_struct_mode_blocks_typos_on_plain_access():
    cfg = compose("prep", ["out=x"])
    with pytest.raises((ConfigKeyError, ConfigAttributeError)):
        _ = cfg.data.max_lenght
