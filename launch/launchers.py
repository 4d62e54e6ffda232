"""Turn a train config into a real multi-node job: a SLURM sbatch script, torchrun or DeepSpeed
launcher commands. Every rank runs `python -m launch train <the same overrides>`."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from launch.config import DeepSpeedLauncher, SlurmLauncher, TorchrunLauncher


def train_overrides(task_overrides: list[str]) -> list[str]:
    """The user's train overrides: the launch command's own keys (launcher.*, dry_run) dropped."""
    # trainer.num_nodes / trainer.devices are dropped too: the launcher sets them
    own = ("launcher", "dry_run", "trainer.num_nodes", "trainer.devices")
    keys = [o.lstrip("+~").split("=", 1)[0] for o in task_overrides]
    return [
        o
        for o, key in zip(task_overrides, keys, strict=True)
        if key not in own and not key.startswith("launcher.")
    ]


def train_command(overrides: list[str]) -> list[str]:
    """What every rank runs."""
    return [sys.executable, "-m", "launch", "train", *overrides]


def sbatch_script(
    sl: SlurmLauncher, overrides: list[str], out: str, workdir: str, body: list[str] | None = None
) -> str:
    """An sbatch script that runs the training with one srun task per device (or, with `body`,
    those shell lines instead, under the same allocation, signal and requeue settings)."""
    resume = [] if any(o.split("=")[0] == "resume" for o in overrides) else ["resume=auto"]
    ranks = [f"trainer.num_nodes={sl.nodes}", f"trainer.devices={sl.tasks_per_node}"]
    cmd = train_command([*overrides, *ranks, *resume])
    run = body if body is not None else [f"srun --kill-on-bad-exit=1 {shlex.join(cmd)}"]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={sl.job_name}",
        f"#SBATCH --nodes={sl.nodes}",
        f"#SBATCH --ntasks-per-node={sl.tasks_per_node}",
        f"#SBATCH --cpus-per-task={sl.cpus_per_task}",
        f"#SBATCH --time={sl.time}",
        f"#SBATCH --output={out}/slurm-%j.out",
        f"#SBATCH --chdir={workdir}",
    ]
    if sl.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={sl.gpus_per_node}")
    optional = ("mem", "partition", "account", "qos")
    lines += [f"#SBATCH --{k}={getattr(sl, k)}" for k in optional if getattr(sl, k) is not None]
    if sl.requeue:
        # Lightning's SLURM environment catches SIGUSR1: saves hpc_ckpt_N.ckpt, requeues the
        # job; the requeued job resumes from it (resume=auto).
        lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
        lines.append(f"#SBATCH --signal=SIGUSR1@{sl.signal_seconds}")
    lines += [f"#SBATCH {a}" for a in sl.sbatch_args]
    lines += [
        "",
        "set -euo pipefail",
        *sl.setup,
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
        'echo "hydra-heads: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST"',
        *run,
        "",
    ]
    return "\n".join(lines)


def torchrun_commands(tr: TorchrunLauncher, overrides: list[str]) -> list[list[str]]:
    """One torchrun command per node (node_rank 0 .. nnodes-1)."""
    ranks = [f"trainer.num_nodes={tr.nnodes}", f"trainer.devices={tr.nproc_per_node}"]
    return [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={tr.nnodes}",
            f"--nproc_per_node={tr.nproc_per_node}",
            f"--node_rank={rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={tr.rdzv_endpoint}",
            f"--rdzv_id={tr.rdzv_id}",
            "--module",
            "launch",
            "train",
            *overrides,
            *ranks,
        ]
        for rank in range(tr.nnodes)
    ]


def deepspeed_command(ds: DeepSpeedLauncher, overrides: list[str]) -> list[str]:
    ranks = [f"trainer.num_nodes={ds.num_nodes}", f"trainer.devices={ds.num_gpus}"]
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        f"--hostfile={ds.hostfile}",
        f"--num_nodes={ds.num_nodes}",
        f"--num_gpus={ds.num_gpus}",
        f"--master_port={ds.master_port}",
    ]
    if ds.master_addr:
        cmd.append(f"--master_addr={ds.master_addr}")
    return [*cmd, "--module", "launch", "train", *overrides, *ranks]


def script_path(sl: SlurmLauncher, out: str) -> Path:
    return Path(sl.script) if sl.script else Path(out) / "launch.sbatch"


def job_argv() -> list[str]:
    """This sweep command's overrides less those a job it starts is given its own of."""
    own = ("backend=", "only=", "worker=", "train_prefix=", "job_")
    return [a for a in sys.argv[1:] if not a.lstrip("+~").startswith(own)]


def sweep_job(cfg, own: list[str], workdir: Path, script: Path, what: str) -> str:
    """Submit one sweep job (a train point, or a search worker): `hydra-heads sweep` with this
    command's overrides, the job's `own` ones, and training under srun sized to
    `cfg.slurm`'s allocation (evals on its first GPU unless the sweep says where). Returns
    the job id; fails naming `what` if sbatch does."""
    import json
    import os
    import subprocess

    from train.core.errors import ConfigError

    sl = cfg.slurm
    job_train = [f"trainer.num_nodes={sl.nodes}", f"trainer.devices={sl.tasks_per_node}"]
    user_eval = [*cfg.sweep.eval, *cfg.eval_args]
    job_eval = (
        ["eval.device=cuda"]
        if sl.gpus_per_node and not any(a.startswith("eval.device=") for a in user_eval)
        else []
    )
    job = [
        sys.executable, "-m", "launch", "sweep", *job_argv(), "backend=local", *own,
        "train_prefix=" + json.dumps(["srun", "--kill-on-bad-exit=1"]),
        "job_train_args=" + json.dumps(job_train),
        "job_eval_args=" + json.dumps(job_eval),
    ]  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    script.write_text(sbatch_script(sl, [], str(workdir), os.getcwd(), body=[shlex.join(job)]))
    try:
        r = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    except FileNotFoundError:
        raise ConfigError("sbatch not found: run backend=slurm on a SLURM login node") from None
    if r.returncode != 0:
        raise ConfigError(f"sbatch failed for {what}: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]
