"""Subcommands of the hydra-heads CLI: one module each (CONFIG_NAME + run(cfg))."""
