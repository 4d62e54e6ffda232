"""`hydra-heads import`: hf / hydra / medusa heads -> our heads dir, checked against the base."""

from __future__ import annotations

from typing import Any

# The subcommand is `import`, a Python keyword, so the module is named import_heads.
CONFIG_NAME = "import"
# A working command line, shown when a required key is missing.
EXAMPLE = "hydra-heads import src=exported/medusa format=medusa base=vicuna_7b out=imported/medusa"


def run(cfg) -> dict[str, Any]:
    from rich.console import Console

    from launch.config import ImportConfig
    from train.core.config import load
    from train.export import import_heads

    typed = load(cfg, ImportConfig, EXAMPLE)  # fails here, before loading the base
    res = import_heads(typed.src, typed.format, typed.base, typed.out, overwrite=typed.overwrite)
    draft = res["draft_vocab_size"]
    Console().print(
        f"imported {res['num_heads']} x {res['num_layers']} {res['arch']} heads"
        f"{f' (draft vocab {draft})' if draft else ''} for base {res['base']}: "
        f"{res['out']}/{{heads.safetensors,heads_config.json}}"
    )
    return res


if __name__ == "__main__":  # `python -m launch.commands.import_heads` runs the same app
    import sys

    from launch.cli import main

    main(["import", *sys.argv[1:]])
