"""`python -m launch <subcommand> ...` is the same as `hydra-heads <subcommand> ...`."""

from launch.cli import main

main()
