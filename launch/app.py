"""Glue between hydra-core and our typed configs: compose, validate, run, report errors clearly."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from train.config import ConfigError

log = logging.getLogger("hydra_heads")
T = TypeVar("T")


def conf_dir() -> Path:
    """The `conf/` tree: $HYDRA_HEADS_CONF, else the one beside the packages (repo checkout)."""
    env = os.environ.get("HYDRA_HEADS_CONF")
    path = Path(env) if env else Path(__file__).resolve().parents[1] / "conf"
    if not path.is_dir():
        raise SystemExit(
            f"error: config tree not found at {path}; run from a checkout installed with "
            "`pip install -e .` or set HYDRA_HEADS_CONF to the conf/ directory"
        )
    return path


def _register_resolvers() -> None:
    """`${conf_path:deepspeed/zero3.json}`: a file shipped in conf/, as an absolute path."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("conf_path", lambda rel: str(conf_dir() / rel), replace=True)


_register_resolvers()


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's input: shown as one clear line, not a traceback."""
    from data_prep.prepare import PrepError
    from data_prep.readers import DataError
    from data_prep.template import TemplateError
    from evaluation.evaluate import LosslessError
    from evaluation.report import ReportError
    from evaluation.tree import TreeError
    from train.base import BaseLoadError
    from train.checkpoint import HeadsMismatchError
    from train.data import PreparedDataError

    return (
        ConfigError,
        DataError,
        PrepError,
        BaseLoadError,
        TemplateError,
        FileNotFoundError,
        FileExistsError,
        PreparedDataError,
        HeadsMismatchError,
        TreeError,
        LosslessError,
        ReportError,
    )


def to_typed(cfg: Any, cls: type[T]) -> T:
    """Resolve a composed DictConfig (minus `hydra`) and validate it into dataclass `cls`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from train.config import from_mapping

    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"config key '{key}' is required but not set: pass {key}=VALUE") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config cannot be resolved: {e}") from None
    data.pop("hydra", None)
    return from_mapping(cls, data)


def resolved_yaml(cfg: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)


def run_app(config_name: str, task: Callable[[Any], Any]) -> None:
    """Run `task(cfg)` as a hydra-core app composed from conf/<config_name>.yaml.

    Command-line overrides are read from sys.argv by hydra. Known user errors exit with
    status 2 and a one-line message naming the key, value and fix.
    """
    import hydra

    @hydra.main(config_path=str(conf_dir()), config_name=config_name, version_base="1.3")
    def _main(cfg):
        try:
            return task(cfg)
        except user_errors() as e:
            log.error("%s", e)
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    _main()
