"""`python -m train [overrides]` is `hydra-heads train [overrides]` (DESIGN.md). An entry point,
not part of the package: nothing imports it, so it sits in the CLI layer with launch/."""

import sys

from launch.cli import main

main(["train", *sys.argv[1:]])
