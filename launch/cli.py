"""`hydra-heads <subcommand> [overrides]`: dispatch to one hydra-core app per subcommand."""

from __future__ import annotations

import importlib
import sys

# name -> (module with CONFIG_NAME and run(cfg), one-line help). One module per subcommand.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "prep": ("launch.commands.prep", "chat data -> tokenized, loss-masked Arrow shards + stats"),
    "train": ("launch.commands.train", "train Medusa / Hydra / Hydra++ heads on prepared data"),
    "eval": ("launch.commands.eval", "speculative vs plain decoding: tau, acceptance, speedup"),
    "report": ("launch.commands.report", "acceptance-rate report (json, md, html, plots) of runs"),
    "sweep": ("launch.commands.sweep", "train + eval every point of a grid, then one report"),
    "export": ("launch.commands.export", "heads -> hf / hydra (zankner/Hydra) / medusa (vLLM)"),
    "import": ("launch.commands.import_heads", "hf / hydra / medusa heads -> our heads dir"),
    "launch": ("launch.commands.launch", "a train config as a SLURM / torchrun / DeepSpeed job"),
    "plan": ("launch.commands.plan", "per-GPU memory of a train config: fits, or what would"),
}

USAGE = """usage: hydra-heads <subcommand> [key=value ...] [hydra flags]

Train Hydra / Hydra++ / Medusa draft heads for speculative decoding.

subcommands:
{commands}

Each subcommand is a hydra-core app composed from conf/: override any key with key=value,
pick a config group option with group=name (e.g. base=tiny_random), show the composed config
with `--cfg job`, and list groups and options with `hydra-heads <subcommand> --help`.
"""


def usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [f"  {n.ljust(width)}  {h}" for n, (_, h) in SUBCOMMANDS.items()]
    return USAGE.format(commands="\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(
            f"error: unknown subcommand '{name}'; choose one of: {', '.join(SUBCOMMANDS)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    # Multi-process launchers (Lightning's DDP / DeepSpeed launcher) start the other ranks by
    # re-running this process as `python -m <__main__.__spec__.name> <argv[1:]>`: make that the
    # subcommand's own module, which runs the same app when executed, with the same overrides.
    sys.argv = [module.__file__, *rest]
    import __main__

    __main__.__spec__ = module.__spec__
    from launch.app import run_app

    run_app(module.CONFIG_NAME, module.run)


if __name__ == "__main__":
    main()
