"""`hydra-heads export`: validate the config, write heads in the hf / hydra / medusa layout."""

from __future__ import annotations

from typing import Any

CONFIG_NAME = "export"
# A working command line, shown when a required key is missing.
EXAMPLE = "hydra-heads export heads=runs/hpp/heads format=hf out=exported/hpp"


def run(cfg) -> dict[str, Any]:
    from rich.console import Console

    from launch.config import ExportConfig
    from train.core.config import load
    from train.export import export_heads

    typed = load(cfg, ExportConfig, EXAMPLE)  # fails here, before reading any weights
    res = export_heads(
        typed.heads,
        typed.format,
        typed.out,
        eval_json=typed.eval,
        base_model=typed.base_model,
        overwrite=typed.overwrite,
    )
    console = Console()
    console.print(
        f"exported {res['arch']} heads as format={res['format']}: {res['out']}/"
        f"{{{','.join(res['files'])}}}"
    )
    for note in res["notes"]:
        console.print(f"note: {note}")
    return res


if __name__ == "__main__":  # `python -m launch.commands.export` runs the same app
    import sys

    from launch.cli import main

    main(["export", *sys.argv[1:]])
