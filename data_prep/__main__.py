"""`python -m data_prep [overrides]` is `hydra-heads prep [overrides]`.
An entry point, not part of the package: nothing imports it, so it sits in the CLI layer with
launch/ (docs/architecture.md)."""

import sys

from launch.cli import main

main(["prep", *sys.argv[1:]])
