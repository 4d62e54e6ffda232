"""`hydra-heads launch`: render and submit (or run) a multi-node training job."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

CONFIG_NAME = "launch"
# A working command line, shown when a required key is missing.
EXAMPLE = (
    "hydra-heads launch launcher=slurm data.prepared=/shared/data out=/shared/runs/hpp dry_run=true"
)


def run(cfg) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    from launch.config import LaunchConfig
    from launch.launchers import (
        deepspeed_command,
        sbatch_script,
        script_path,
        torchrun_commands,
        train_overrides,
    )
    from train.core.config import load
    from train.core.errors import ConfigError

    typed = load(cfg, LaunchConfig, EXAMPLE)  # the job's config must be valid before submitting
    lc, dry, name = typed.launcher, typed.dry_run, typed.launcher.name
    overrides = train_overrides(list(HydraConfig.get().overrides.task))
    out = str(Path(typed.out).resolve())

    if name == "slurm":
        script = sbatch_script(lc, overrides, out, os.getcwd())
        if dry:
            print(script)
            return {"script": script}
        path = script_path(lc, out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(script)
        args = ["sbatch", "--parsable", *(["--wait"] if lc.wait else []), str(path)]
        try:
            r = subprocess.run(args, capture_output=True, text=True)
        except FileNotFoundError:
            raise ConfigError(
                "sbatch not found: run on a SLURM login node, or dry_run=true"
            ) from None
        job = r.stdout.strip().split(";")[0]
        if r.returncode != 0 and not job:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}")
        print(f"submitted job {job}: {path} (log: {out}/slurm-{job}.out)")
        if lc.wait and r.returncode != 0:
            raise SystemExit(f"error: job {job} ended with status {r.returncode}")
        return {"job_id": job, "script": str(path)}

    cmds = (
        torchrun_commands(lc, overrides)
        if name == "torchrun"
        else [deepspeed_command(lc, overrides)]
    )
    if dry or (name == "torchrun" and lc.node_rank is None):
        for i, c in enumerate(cmds):
            label = f"# node {i}\n" if name == "torchrun" else ""
            print(f"{label}{shlex.join(c)}")
        return {"commands": cmds}
    cmd = cmds[lc.node_rank] if name == "torchrun" else cmds[0]
    raise SystemExit(subprocess.call(cmd))


if __name__ == "__main__":  # how multi-process launchers re-run this subcommand on other ranks
    import sys

    from launch.cli import main

    main(["launch", *sys.argv[1:]])
