"""The one base class of errors caused by the user's input: the CLI prints them as one line."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, data, files, checkpoints): the message names the problem and the fix.

    The CLI prints these as `error: <message>` and exits with status 2, never a traceback.
    """


class ConfigError(UserError, ValueError):
    """A config value is missing, of the wrong type, or not allowed."""


class InvalidValue(ConfigError):
    """`key` (dotted, relative to the schema that raised it) holds `value`; `allowed` says what
    would be accepted. Validation makes `key` absolute before the user sees it."""

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"config key '{key}' = {value!r} is invalid: {allowed}")


class NotFound(UserError, FileNotFoundError):
    """A file or directory the user named does not exist or is incomplete."""


class AlreadyExists(UserError, FileExistsError):
    """An output would replace something the user did not ask to replace."""
