"""The hydra-core config tree, installed as the package `hydra_heads_conf` (see pyproject)."""
