"""`hydra-heads plan`: per-device memory table for a training config and a fits / change verdict."""

from __future__ import annotations

from typing import Any

CONFIG_NAME = "plan"
# A working command line, shown when a required key is missing.
EXAMPLE = "hydra-heads plan experiment=vicuna7b_8xa100"


def run(cfg) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from launch.config import PlanConfig
    from train.core.config import load
    from train.core.errors import ConfigError
    from train.plan import GIB, GPUS_GB, base_arch, estimate, verdict

    typed = load(cfg, PlanConfig, EXAMPLE)
    gpu, gb = typed.gpu, typed.gpu_memory_gb
    if gb is None:
        if gpu not in GPUS_GB:
            raise ConfigError(
                f"gpu={gpu!r}: choose one of {', '.join(GPUS_GB)} or set gpu_memory_gb"
            )
        gb = GPUS_GB[gpu]
    arch = base_arch(typed.base)
    est = estimate(typed, arch)
    v = verdict(typed, arch, float(gb))
    st = est["setup"]
    t = Table(
        title=f"memory per {'GPU' if st['device'] == 'gpu' else 'process'}: {typed.base.name}, "
        f"{typed.head.name} x{typed.head.num_heads}, {st['strategy']} on {st['world']} "
        f"device(s), batch {est['batch']['batch_size']} x {est['batch']['max_length']}"
    )
    t.add_column("component")
    t.add_column("GiB", justify="right")
    for name, b in est["rows"].items():
        t.add_row(name, f"{b / GIB:.2f}")
    if est["runtime_overhead"]:
        what = "CUDA context + allocator slack" if st["device"] == "gpu" else "process overhead"
        t.add_row(what, f"{est['runtime_overhead'] / GIB:.2f}")
    t.add_row("[b]total[/b]", f"[b]{v['need_gb']:.2f}[/b]")
    console = Console(width=110)
    console.print(t)
    n = est["params"]
    frozen = f" + {n['heads_frozen'] / 1e6:.1f} M frozen" if n["heads_frozen"] else ""
    console.print(
        f"base {n['base'] / 1e9:.2f} B params, heads {n['heads'] / 1e6:.1f} M trainable{frozen}"
    )
    label = gpu if typed.gpu_memory_gb is None else f"{gb} GB device"
    if v["fits"]:
        console.print(f"[green]fits[/] on {label} ({v['need_gb']:.1f} of {gb} GB)")
    else:
        msg = f"[red]does not fit[/] on {label} ({v['need_gb']:.1f} of {gb} GB)"
        if "suggestion" in v:
            msg += f"; smallest change that fits: {v['suggestion']} ({v['suggestion_gb']:.1f} GB)"
        console.print(msg)
    return {"estimate": est, "verdict": v}


if __name__ == "__main__":  # how multi-process launchers re-run this subcommand on other ranks
    import sys

    from launch.cli import main

    main(["plan", *sys.argv[1:]])
