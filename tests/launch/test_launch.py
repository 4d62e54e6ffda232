"""`hydra-heads launch`: sbatch / torchrun / DeepSpeed commands from a train config, and a real
submission to a one-node SLURM cluster on localhost (.ci/run starts it)."""

from __future__ import annotations

import json

import pytest

from launch.config import SlurmLauncher
from launch.launchers import sbatch_script, train_overrides
from tests.helpers import run, run_here, slurm_up
from train.core.config import from_group

TRAIN = ["out=/tmp/job", "data.prepared=/tmp/p"]


def test_sbatch_script_from_a_recipe():
    r = run(
        "launch",
        "trainer=deepspeed_zero3",
        "trainer.num_nodes=4",
        "launcher.partition=gpu",
        "launcher.account=proj",
        "launcher.time=12:00:00",
        "launcher.setup=[module load cuda]",
        "dry_run=true",
        *TRAIN,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = r.stdout
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --time=12:00:00",
        "#SBATCH --requeue",
        "#SBATCH --signal=SIGUSR1@120",
        "module load cuda",
    ):
        assert line in s, line
    srun = next(x for x in s.splitlines() if x.startswith("srun "))
    assert "-m launch train trainer=deepspeed_zero3" in srun
    assert "trainer.num_nodes=4 trainer.devices=8 resume=auto" in srun
    assert "dry_run" not in srun and "launcher." not in srun
    assert srun.count("trainer.num_nodes") == 1


def test_torchrun_and_deepspeed_commands():
    # in this process: test_sbatch_script_from_a_recipe runs `hydra-heads launch` for real
    r = run_here(
        "launch",
        "launcher=torchrun",
        "trainer=ddp",
        "trainer.num_nodes=2",
        "launcher.rdzv_endpoint=node0:29400",
        "dry_run=true",
        *TRAIN,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    nodes = [x for x in r.stdout.splitlines() if "torch.distributed.run" in x]
    assert len(nodes) == 2 and "--node_rank=1" in nodes[1]
    assert all("--rdzv_endpoint=node0:29400" in x and "--module launch train" in x for x in nodes)
    r = run_here(
        "launch",
        "launcher=deepspeed",
        "trainer=deepspeed_zero2",
        "launcher.hostfile=hf",
        "dry_run=true",
        *TRAIN,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "deepspeed.launcher.runner --hostfile=hf --num_nodes=1 --num_gpus=8" in r.stdout


def test_launch_validates_the_train_config_first():
    r = run_here("launch", "trainer.max_steps=-3", "dry_run=true", *TRAIN)
    assert r.returncode == 2 and "trainer.max_steps" in r.stderr


def test_override_filter_and_cpu_script():
    assert train_overrides(
        [
            "launcher=slurm",
            "launcher.nodes=2",
            "dry_run=true",
            "head=hydra",
            "trainer.devices=4",
            "+x.y=1",
        ]
    ) == ["head=hydra", "+x.y=1"]
    s = sbatch_script(
        from_group(SlurmLauncher, "launcher", "slurm", nodes=1, tasks_per_node=2, gpus_per_node=0),
        ["a=1"],
        "/o",
        "/w",
    )
    assert "--gpus-per-node" not in s and "#SBATCH --chdir=/w" in s


@pytest.mark.skipif(not slurm_up(), reason="no SLURM cluster (launch/slurm/local_cluster_up.sh)")
@pytest.mark.xdist_group("slurm")  # one xdist worker runs the SLURM tests, one after another
def test_real_slurm_job_trains_with_two_tasks(tiny_prepared, tmp_path):
    out = tmp_path / "job"
    r = run(
        "launch",
        "launcher=slurm",
        "launcher.gpus_per_node=0",
        "launcher.cpus_per_task=1",
        "launcher.time=00:10:00",
        "launcher.wait=true",
        "base=tiny_random",
        "head=hydra_pp",
        "head.num_heads=2",
        "trainer=ddp_cpu",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "logger=none",
        "data.batch_size=2",
        "final_validation=false",
        f"data.prepared={tiny_prepared}",
        f"out={out}",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "submitted job" in r.stdout
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2
    assert summary["cluster"] == "SLURMEnvironment"
    assert (out / "heads" / "heads.safetensors").is_file()
    assert list(out.glob("slurm-*.out")) and (out / "launch.sbatch").is_file()


@pytest.mark.skipif(not slurm_up(), reason="no SLURM cluster (launch/slurm/local_cluster_up.sh)")
@pytest.mark.xdist_group("slurm")  # one xdist worker runs the SLURM tests, one after another
def test_sweep_points_run_as_slurm_jobs_through_submitit(tiny_prepared, tmp_path):
    """`hydra-heads train -m ... hydra/launcher=submitit_slurm`: one SLURM job per point."""
    r = run(
        "train",
        "-m",
        "head=medusa,hydra",
        "base=tiny_random",
        f"out={tmp_path}/${{head.name}}",
        f"data.prepared={tiny_prepared}",
        "trainer.max_steps=2",
        "logger=none",
        "final_validation=false",
        "data.batch_size=2",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.timeout_min=10",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.tasks_per_node=1",
        "hydra.launcher.gpus_per_node=0",
        f"hydra.sweep.dir={tmp_path}/multirun",
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for head in ("medusa", "hydra"):
        meta = json.loads((tmp_path / head / "heads" / "heads_config.json").read_text())
        assert meta["arch"] == head and meta["training"]["steps"] == 2
    assert list((tmp_path / "multirun").rglob("*_log.out"))  # submitit's per-job SLURM logs
