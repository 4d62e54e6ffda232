"""Schemas of the job-level subcommands: launch, plan, sweep, export and import."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from evaluation.config import SORT_KEYS
from launch.grid import grid_value_key, held_extras, override_value, parse_grid
from train.config import TrainConfig
from train.core.base import BaseConfig
from train.core.config import ConfigModel, NonNegative, Positive, check, fail
from train.export import Format

log = logging.getLogger(__name__)


# -- launchers (`launcher=<option>`, told apart by `name`) -------------------------------------
class SlurmLauncher(ConfigModel):
    """`launcher=slurm`: one sbatch job, one task per device, Lightning's SLURM integration."""

    name: Literal["slurm"]
    nodes: Positive
    tasks_per_node: Positive  # = devices per node: Lightning expects one task per GPU
    gpus_per_node: Annotated[int, check(lambda v: v >= 0, "an integer >= 0 (0: a CPU job)")]
    cpus_per_task: Positive
    mem: str | None  # e.g. "0" (all of the node) or "480G"; null: the cluster default
    time: str
    partition: str | None
    account: str | None
    qos: str | None
    job_name: str
    setup: list[str]  # shell lines before srun (modules, venv)
    sbatch_args: list[str]  # more options, e.g. "--exclusive"
    requeue: bool  # on pre-emption / time limit: checkpoint, requeue, resume
    signal_seconds: NonNegative  # SIGUSR1 this long before the limit: Lightning saves, requeues
    script: str | None  # where the sbatch script goes (default <out>/launch.sbatch)
    wait: bool  # block until the job ends (sbatch --wait); exit with its status


class TorchrunLauncher(ConfigModel):
    """`launcher=torchrun`: one torchrun per node, c10d rendezvous at `rdzv_endpoint`."""

    name: Literal["torchrun"]
    nnodes: Positive
    nproc_per_node: Positive
    node_rank: NonNegative | None  # run this node's command; null with dry_run: print all
    rdzv_endpoint: str
    rdzv_id: str

    @model_validator(mode="after")
    def _rank(self) -> TorchrunLauncher:
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            fail("node_rank", self.node_rank, f"an integer in [0, {self.nnodes})")
        return self


class DeepSpeedLauncher(ConfigModel):
    """`launcher=deepspeed`: DeepSpeed's own launcher over the hosts of a hostfile (pdsh)."""

    name: Literal["deepspeed"]
    hostfile: str  # lines "host slots=8"
    num_nodes: Positive
    num_gpus: Positive
    master_addr: str | None
    master_port: Positive


Launcher = Annotated[
    SlurmLauncher | TorchrunLauncher | DeepSpeedLauncher, Field(discriminator="name")
]


class LaunchConfig(TrainConfig):
    """`hydra-heads launch` (conf/launch.yaml): a train config plus how to start it."""

    launcher: Launcher
    dry_run: bool  # print the script / commands instead of submitting or running them


class PlanConfig(TrainConfig):
    """`hydra-heads plan` (conf/plan.yaml): a train config plus the device it must fit."""

    gpu: str  # a100_40gb | a100_80gb | h100_80gb | h200 | l40s | a10g
    gpu_memory_gb: Annotated[float, check(lambda v: v > 0, "GB > 0")] | None


# -- sweep -----------------------------------------------------------------------------------
PER_POINT_KEYS = ("out", "resume")  # a sweep's train overrides may not set these
PER_POINT_RULE = "no out= or resume= (the sweep sets them per point)"


def _override_key(o: str) -> str:
    """`+head.x=1` -> `head.x`: the key an override sets."""
    return o.split("=", 1)[0].lstrip("+~")


Grid = dict[str, Annotated[list[Any], check(bool, "a non-empty list of values")]]


class SearchParam(ConfigModel):
    """One train key of a search space: `choices`, or a `low`..`high` range (`integer` for
    integers, `log` for a log scale)."""

    choices: list[Any] | None = None
    low: float | None = None
    high: float | None = None
    integer: bool = False
    log: bool = False

    @model_validator(mode="after")
    def _kind(self) -> SearchParam:
        ranged = self.low is not None or self.high is not None
        if (self.choices is None) == (not ranged):
            fail("space", self.model_dump(), "either choices: [...] or low: and high:")
        if self.choices is not None and not self.choices:
            fail("choices", self.choices, "a non-empty list of values")
        if ranged:
            if self.low is None or self.high is None or not self.low < self.high:
                fail("low / high", (self.low, self.high), "both set, low < high")
            if self.log and self.low <= 0:
                fail("low", self.low, "> 0 on a log scale")
        return self


class SearchSpec(ConfigModel):
    """`sweep.search`: a budgeted Optuna search in place of a grid. Its study lives in
    <out>/study.db (SQLite; see `storage`), so a killed search resumes where it stopped."""

    backend: Literal["optuna"]
    trials: Positive  # finished trials (complete or failed) the search runs to
    sampler: Literal["tpe", "random"]
    seed: int
    # tau: eval's measured tau; tau_per_train_minute: tau / minutes of training (fit_s)
    objective: Literal["tau", "tau_per_train_minute"]
    space: Annotated[dict[str, SearchParam], check(bool, "at least one train key to search")]


class SweepSpec(ConfigModel):
    """One sweep (`conf/sweep/*.yaml`): grids of overrides and the overrides every point shares,
    or a search over train keys (`search`)."""

    name: str
    grid: Grid  # train overrides, crossed
    eval_grid: Grid  # eval overrides, crossed
    train: list[str]  # shared by every train point
    # More train overrides for the points that hold one grid value, after the grid's own, keyed
    # by grid key then value: {"head": {"eagle3": ["head.num_heads=3", "trainer.max_steps=560"]}}
    # (e.g. each architecture's step count at equal training time). Not in the points' names.
    extra: dict[str, dict[Any, list[str]]] = Field(default_factory=dict)
    eval: list[str]  # shared by every eval point
    sort_by: Literal[SORT_KEYS]  # type: ignore[valid-type]
    search: SearchSpec | None = None  # null: the grid

    @model_validator(mode="after")
    def _rules(self) -> SweepSpec:
        if self.search is not None and (self.grid or self.eval_grid):
            fail(
                "grid",
                self.grid or self.eval_grid,
                "a search draws its own points from search.space: leave grid and eval_grid "
                "empty ({})",
            )
        if self.search is not None and self.extra:
            fail("extra", self.extra, "a search has no grid values to add overrides to: {}")
        if self.search is None and not self.grid and not self.eval_grid:
            fail("grid", self.grid, "at least one key with a list of values")
        for o in [*self.train, *self.eval]:
            if "=" not in o:
                fail("train / eval", o, "overrides of the form key=value")
        for o in self.train:
            if _override_key(o) in PER_POINT_KEYS:
                fail("train", o, PER_POINT_RULE)
        self._check_extra()
        return self

    def _check_extra(self) -> None:
        for key, by_value in self.extra.items():
            if key not in self.grid:
                fail("extra", key, f"a key of the grid, one of {sorted(self.grid)}")
            values = [override_value(v) for v in self.grid[key]]
            held = {grid_value_key(v) for v in self.grid[key]}
            for value, overrides in by_value.items():
                where = f"extra.{key}.{override_value(value)}"
                if grid_value_key(value) not in held:
                    fail(f"extra.{key}", value, f"one of the grid's values {values}")
                for o in overrides:
                    name = _override_key(o)
                    if "=" not in o:
                        fail(where, o, "overrides of the form key=value")
                    if name in PER_POINT_KEYS:
                        fail(where, o, PER_POINT_RULE)
                    if name in self.grid:
                        fail(
                            where,
                            o,
                            f"a key the grid does not set ({name} is a grid key: two points "
                            "would differ in name only)",
                        )


# What makes a sweep the same sweep on resume (sort_by may change freely).
IDENTITY = ("grid", "eval_grid", "train", "extra", "eval", "search")


class SweepConfig(ConfigModel):
    """`hydra-heads sweep` (conf/sweep.yaml)."""

    out: str
    sweep: SweepSpec
    # Appended to every point's train / eval command; not part of the sweep's identity, so a
    # resumed sweep may point at data that moved (e.g. data.prepared=DIR).
    train_args: list[str]
    eval_args: list[str]
    # Command-line grids in hydra's multirun style, replacing the sweep file's grids:
    #   'grid=["head=medusa,hydra","head.num_layers=1,2"]' 'eval_grid=["tree=chain,sparse_15"]'
    grid: list[str] | None
    eval_grid: list[str] | None
    backend: Literal["local", "slurm"]
    only: str | None  # run this train point only (what a SLURM point job runs)
    max_failures: Positive | None  # stop after this many failed points (default: never)
    report: bool
    dry_run: bool  # list the points and their commands, run nothing, write nothing
    slurm: SlurmLauncher  # each point job's allocation
    # Set by backend=slurm in each point job's command line: the train step's command prefix
    # (srun) and the overrides that size it to the allocation.
    train_prefix: list[str]
    job_train_args: list[str]
    job_eval_args: list[str]
    # A search's execution, not part of its identity (launch/search.py): trials at once (local
    # worker processes, or SLURM jobs with backend=slurm), where the study lives, threads per
    # local worker (null: this machine's cores shared out), and the worker a process is (set
    # on each worker's own command line).
    workers: Positive
    storage: (
        Annotated[
            str,
            check(
                lambda v: v == "journal" or "://" in v,
                "null (<out>/study.db), journal (<out>/study.journal) or an RDB URL such as "
                "postgresql://user@host/db",
            ),
        ]
        | None
    )
    threads_per_worker: Positive | None
    worker: str | int | None  # worker=0 reads as an int

    @model_validator(mode="after")
    def _command_line_grids(self) -> SweepConfig:
        if self.sweep.search is None and self.workers > 1:
            fail(
                "workers",
                self.workers,
                "1 for a grid (workers run a search's trials at once; a grid's points run at "
                "once with backend=slurm)",
            )
        if self.grid is None and self.eval_grid is None:
            return self
        spec = self.sweep.model_dump()
        if self.grid is not None:
            spec["grid"] = parse_grid("grid", self.grid)
        if self.eval_grid is not None:
            spec["eval_grid"] = parse_grid("eval_grid", self.eval_grid)
        # a grid replaced on the command line keeps the extras of the values it still holds
        spec["extra"], dropped = held_extras(spec["extra"], spec["grid"])
        if dropped:
            log.warning(
                "the command-line grid holds no %s: their sweep.extra overrides are not used",
                ", ".join(dropped),
            )
        self.sweep = SweepSpec(**spec)
        return self


# -- export / import ---------------------------------------------------------------------------


class ExportConfig(ConfigModel):
    """`hydra-heads export` (conf/export.yaml)."""

    heads: str  # a heads checkpoint dir (<train out>/heads)
    format: Format
    out: str
    eval: str | None  # hf: an eval.json for the model card (default: one found nearby)
    base_model: str | None  # base id written into the files (default: the recorded one)
    overwrite: bool

    @model_validator(mode="after")
    def _card(self) -> ExportConfig:
        if self.eval is not None and self.format != "hf":
            fail("eval", self.eval, "only format=hf writes a model card; drop eval= or use hf")
        return self


class ImportConfig(ConfigModel):
    """`hydra-heads import` (conf/import.yaml)."""

    src: str  # a directory in `format`
    format: Format
    out: str  # written as a heads checkpoint dir (heads.safetensors + heads_config.json)
    base: BaseConfig | None  # default (hf only): the base recorded in its config.json
    overwrite: bool

    @model_validator(mode="after")
    def _base(self) -> ImportConfig:
        if self.base is None and self.format != "hf":
            fail(
                "base",
                None,
                f"format={self.format} heads do not record a base we can load: pass base=NAME "
                "(e.g. base=vicuna_7b) for the model they were trained on",
            )
        return self
