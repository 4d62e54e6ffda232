"""Run a subcommand as a hydra-core app: compose conf/, validate, run, report user errors."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from train.core.config import conf_dir, register_resolvers
from train.core.errors import UserError

log = logging.getLogger("hydra_heads")


def log_to_files(message: str, logger: logging.Logger = log) -> int:
    """Write `message` as an ERROR record to the log files `logger` reaches (hydra's file
    handler, `<run dir>/<job>.log`, where the job logging config has one), never to the
    console: there `run_app` prints the error itself, once. Returns how many files got it."""
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    written = 0
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
                handler.handle(record)
                written += 1
        current = current.parent if current.propagate else None
    return written


def run_app(config_name: str, task: Callable[[Any], Any]) -> None:
    """Run `task(cfg)` as a hydra-core app composed from conf/<config_name>.yaml.

    Command-line overrides are read from sys.argv by hydra. A `UserError` (bad config, data,
    files or checkpoints) exits with status 2 and its message, printed once as `error: ...` on
    stderr (and kept in the run's log file, if logging writes one), never a traceback.
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
            # The console handler would show it a second time beside the `error:` line.
            log_to_files(str(e))
            fail(e)

    _main()
