"""Turn a train config into a real multi-node job: a SLURM sbatch script, torchrun or DeepSpeed
launcher commands. Every rank runs `python -m launch train <the same overrides>`."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from train.config import fail


@dataclass
class SlurmLauncher:
    """`launcher=slurm`: one sbatch job, one task per device, Lightning's SLURM integration."""

    name: Literal["slurm"] = "slurm"
    nodes: int = 1
    tasks_per_node: int = 8  # = devices per node: Lightning expects one task per GPU
    gpus_per_node: int = 8  # 0 for a CPU job
    cpus_per_task: int = 8
    mem: str | None = None  # e.g. "0" (all of the node) or "480G"; null: the cluster default
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str = "hydra-heads"
    setup: list[str] = field(default_factory=list)  # shell lines before srun (modules, venv)
    sbatch_args: list[str] = field(default_factory=list)  # more options, e.g. "--exclusive"
    requeue: bool = True  # on pre-emption / time limit: checkpoint, requeue, resume
    signal_seconds: int = 120  # SIGUSR1 this long before the limit: Lightning saves + requeues
    script: str | None = None  # where the sbatch script goes (default <out>/launch.sbatch)
    wait: bool = False  # block until the job ends (sbatch --wait); exit with its status

    def __post_init__(self) -> None:
        for key in ("nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, key) < 1:
                fail(key, getattr(self, key), "a positive integer")
        if self.gpus_per_node < 0:
            fail("gpus_per_node", self.gpus_per_node, "an integer >= 0 (0: a CPU job)")
        if self.signal_seconds < 0:
            fail("signal_seconds", self.signal_seconds, "seconds >= 0")


@dataclass
class TorchrunLauncher:
    """`launcher=torchrun`: one torchrun per node, c10d rendezvous at `rdzv_endpoint`."""

    name: Literal["torchrun"] = "torchrun"
    nnodes: int = 1
    nproc_per_node: int = 8
    node_rank: int | None = None  # run this node's command; null with dry_run: print all
    rdzv_endpoint: str = "localhost:29500"
    rdzv_id: str = "hydra-heads"

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            fail("nnodes", (self.nnodes, self.nproc_per_node), "positive integers")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            fail("node_rank", self.node_rank, f"an integer in [0, {self.nnodes})")


@dataclass
class DeepSpeedLauncher:
    """`launcher=deepspeed`: DeepSpeed's own launcher over the hosts of a hostfile (pdsh)."""

    name: Literal["deepspeed"] = "deepspeed"
    hostfile: str = "hostfile"  # lines "host slots=8"
    num_nodes: int = 1
    num_gpus: int = 8
    master_addr: str | None = None
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_gpus < 1:
            fail("num_nodes", (self.num_nodes, self.num_gpus), "positive integers")


LAUNCHERS = {"slurm": SlurmLauncher, "torchrun": TorchrunLauncher, "deepspeed": DeepSpeedLauncher}


def train_overrides(task_overrides: list[str]) -> list[str]:
    """The user's train overrides: the launch command's own keys (launcher.*, dry_run) dropped."""
    keep = []
    for o in task_overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key == "launcher" or key.startswith("launcher.") or key == "dry_run":
            continue
        if key in ("trainer.num_nodes", "trainer.devices"):  # the launcher sets these
            continue
        keep.append(o)
    return keep


def _q(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def train_command(overrides: list[str], python: str | None = None) -> list[str]:
    """What every rank runs."""
    return [python or sys.executable, "-m", "launch", "train", *overrides]


def sbatch_script(
    sl: SlurmLauncher,
    overrides: list[str],
    out: str,
    workdir: str,
    python: str | None = None,
    body: list[str] | None = None,
) -> str:
    """An sbatch script that runs the training with one srun task per device (or, with `body`,
    those shell lines instead, under the same allocation, signal and requeue settings)."""
    resume = [] if any(o.split("=")[0] == "resume" for o in overrides) else ["resume=auto"]
    ranks = [f"trainer.num_nodes={sl.nodes}", f"trainer.devices={sl.tasks_per_node}"]
    cmd = train_command([*overrides, *ranks, *resume], python)
    run = body if body is not None else [f"srun --kill-on-bad-exit=1 {_q(cmd)}"]
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
    for key in ("mem", "partition", "account", "qos"):
        if getattr(sl, key) is not None:
            lines.append(f"#SBATCH --{key}={getattr(sl, key)}")
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


def torchrun_commands(
    tr: TorchrunLauncher, overrides: list[str], python: str | None = None
) -> list[list[str]]:
    """One torchrun command per node (node_rank 0 .. nnodes-1)."""
    ranks = [f"trainer.num_nodes={tr.nnodes}", f"trainer.devices={tr.nproc_per_node}"]
    out = []
    for rank in range(tr.nnodes):
        out.append(
            [
                python or sys.executable,
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
        )
    return out


def deepspeed_command(
    ds: DeepSpeedLauncher, overrides: list[str], python: str | None = None
) -> list[str]:
    ranks = [f"trainer.num_nodes={ds.num_nodes}", f"trainer.devices={ds.num_gpus}"]
    cmd = [
        python or sys.executable,
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
