"""`python -m train [overrides]` is `hydra-heads train [overrides]`.
An entry point, not part of the package: nothing imports it, so it sits in the CLI layer with
launch/ (docs/architecture.md)."""

import sys

from launch.cli import main

main(["train", *sys.argv[1:]])
