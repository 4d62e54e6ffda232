"""`python -m data_prep [overrides]` is the same as `hydra-heads prep [overrides]`."""

import sys

from launch.cli import main

main(["prep", *sys.argv[1:]])
