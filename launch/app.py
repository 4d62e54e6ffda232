"""Run a subcommand as a hydra-core app: compose conf/, validate, run, report user errors."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from train.core.config import conf_dir, register_resolvers
from train.core.errors import UserError

log = logging.getLogger("hydra_heads")


def run_app(config_name: str, task: Callable[[Any], Any]) -> None:
    """Run `task(cfg)` as a hydra-core app composed from conf/<config_name>.yaml.

    Command-line overrides are read from sys.argv by hydra. A `UserError` (bad config, data,
    files or checkpoints) exits with status 2 and its message, never a traceback.
    """
    import hydra

    def fail(e: UserError):
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    try:
        register_resolvers()
        conf = str(conf_dir())
    except UserError as e:  # no config tree installed (hydra's logging is not set up yet)
        fail(e)

    @hydra.main(config_path=conf, config_name=config_name, version_base="1.3")
    def _main(cfg):
        try:
            return task(cfg)
        except UserError as e:
            log.error("%s", e)  # into the run's log too
            fail(e)

    _main()
