"""Schemas of `hydra-heads eval` and `report` (conf/eval.yaml, conf/tree/, conf/report.yaml)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from train.core.base import BaseConfig
from train.core.config import ConfigModel, NonNegative, Positive, check, fail
from train.decoding.tree import PRESETS

SORT_KEYS = ("tau", "speedup", "tau_est", "val_loss", "name")


# -- trees: one schema per kind (`tree=<option>`), told apart by `kind` ------------------------
class PresetTree(ConfigModel):
    """A named tree: `chain` (as deep as the heads) or one of train.decoding.tree.PRESETS."""

    kind: Literal["preset"]
    name: Annotated[
        str,
        check(lambda v: v == "chain" or v in PRESETS, f"one of chain, {', '.join(PRESETS)}"),
    ]


class BranchingTree(ConfigModel):
    """A full tree with branching[d] children per node at depth d."""

    kind: Literal["branching"]
    branching: Annotated[list[Positive], check(bool, "a non-empty list, e.g. [3, 2, 2]")]


class PathsTree(ConfigModel):
    """Explicit Medusa-format paths of top-k ranks."""

    kind: Literal["paths"]
    paths: list[list[NonNegative]]


class FileTree(ConfigModel):
    """A tree.json written by an earlier eval."""

    kind: Literal["file"]
    path: str


class CalibratedTree(ConfigModel):
    """Grown from each head's measured top-k acceptance on held-out prepared rows."""

    kind: Literal["calibrated"]
    budget: Positive  # at most this many draft nodes
    topk: Positive  # ranks per head measured
    calibration_rows: Positive  # held-out prepared rows measured
    calibration_length: Positive  # tokens per row


class AutoTree(CalibratedTree):
    """The calibrated tree (or none) with the best expected speedup, timed on this machine."""

    kind: Literal["auto"]  # type: ignore[assignment]
    # speculate only if a tree is expected to beat plain decoding by this ratio
    min_speedup: Annotated[float, check(lambda v: v >= 1, "a ratio >= 1")]


class DynamicTreeConfig(ConfigModel):
    """Grown anew at each step from the heads' draft probabilities (EAGLE-2 style)."""

    kind: Literal["dynamic"]
    budget: Positive  # draft nodes per step
    expand: Positive  # nodes expanded per depth (the most probable ones)
    width: Positive  # children per expanded node
    depth: Positive | None  # levels (null: as many as the heads)


class TreeShape(ConfigModel):
    """A dynamic tree's shape (tree=temperature's cold and hot ends)."""

    expand: Positive
    width: Positive
    depth: Positive | None  # null: as deep as the heads


class TemperatureTree(ConfigModel):
    """A dynamic tree whose shape follows the sampling temperature: `cold` at 0 (deep and
    narrow), `hot` at `hot_at` and above (broad and shallow), interpolated in between."""

    kind: Literal["temperature"]
    budget: Positive
    cold: TreeShape
    hot: TreeShape
    hot_at: Annotated[float, check(lambda v: v > 0, "a temperature > 0")]


TreeConfig = Annotated[
    PresetTree
    | BranchingTree
    | PathsTree
    | FileTree
    | CalibratedTree
    | AutoTree
    | DynamicTreeConfig
    | TemperatureTree,
    Field(discriminator="kind"),
]


# -- eval -------------------------------------------------------------------------------------
class EvalSettings(ConfigModel):
    """The `eval:` block of conf/eval.yaml."""

    # the prompt set; null: `file` if eval.prompts is given, else `heldout`
    suite: Literal["mt_bench", "humaneval", "heldout", "file"] | None
    prompts: str | None  # eval.suite=file: jsonl of {"prompt": ...}, {"turns": [...]} or chats
    prepared: str | None  # prep output for held-out prompts / calibration (default: the heads')
    num_prompts: Positive
    max_prompt_tokens: Positive  # longer prompts are skipped
    max_new_tokens: Positive
    temperature: Annotated[float, check(lambda v: v >= 0, "a number >= 0")]
    acceptance: Literal["greedy", "typical", "rejection"] | None  # default: by temperature
    posterior_threshold: float  # typical acceptance
    posterior_alpha: float
    check_lossless: bool | None  # default: true for greedy
    compare_plain: bool  # also decode plainly, for the speedup
    seed: int
    device: str
    threads: Positive | None  # torch CPU threads (null: torch's default)
    base_quant: Literal["none", "bf16", "int8"]  # the base's weights (the heads run in its dtype)
    compile: bool  # torch.compile the base's decode and verify forwards
    weight_layout: Literal[
        "auto", "standard", "packed"
    ]  # float32 / bf16 weights prepacked for oneDNN
    batch_size: Positive  # prompts decoded at once (per-row acceptance and KV compaction)
    progress: bool

    @model_validator(mode="after")
    def _rules(self) -> EvalSettings:
        self._suite_rules()
        if self.acceptance is None:
            self.acceptance = "greedy" if self.temperature == 0 else "rejection"
        if (self.temperature == 0) != (self.acceptance == "greedy"):
            fail(
                "acceptance",
                self.acceptance,
                "greedy at temperature 0; typical or rejection at temperature > 0",
            )
        if self.check_lossless is None:
            # a bf16 / int8 base rounds a row differently with another number of rows beside
            # it (kernel blocking, int8's per-call activation scale), so a near-tie can flip
            # and its greedy output is compared (eval.json: identical_to_plain), not enforced
            self.check_lossless = (
                self.acceptance == "greedy" and self.compare_plain and self.base_quant == "none"
            )
        if self.check_lossless and self.acceptance != "greedy":
            fail("check_lossless", True, "only greedy decoding is token-for-token comparable")
        if self.check_lossless and not self.compare_plain:
            fail("check_lossless", True, "it needs compare_plain=true")
        if self.compile and self.base_quant == "int8":
            fail(
                "compile",
                True,
                "torch's dynamic int8 linears do not compile: use eval.base_quant=bf16 or none "
                "with compile, or eval.compile=false with int8",
            )
        if self.compile and self.batch_size > 1:
            fail(
                "compile",
                True,
                "compiled decoding is batch 1 (its graphs and static cache have one row): use "
                "eval.batch_size=1 with compile, or eval.compile=false with batch_size > 1",
            )
        return self

    def _suite_rules(self) -> None:
        """eval.prompts is the file of eval.suite=file and of nothing else."""
        if self.suite is None:
            self.suite = "file" if self.prompts else "heldout"
        if self.suite == "file" and not self.prompts:
            fail(
                "prompts",
                self.prompts,
                "eval.suite=file reads a .jsonl file: pass eval.prompts=FILE.jsonl",
            )
        if self.suite != "file" and self.prompts:
            fail(
                "prompts",
                self.prompts,
                f"read only with eval.suite=file, and eval.suite={self.suite} brings its own "
                "prompts: drop eval.prompts, or set eval.suite=file",
            )


class EvalConfig(ConfigModel):
    """Everything `hydra-heads eval` needs (conf/eval.yaml)."""

    heads: str  # a heads checkpoint dir (<train out>/heads)
    out: str
    tree: TreeConfig
    eval: EvalSettings
    base: BaseConfig | None  # default: the base recorded in the heads' config
    # auto: the CLI logs the figures into the wandb run that trained the heads, if there is one
    wandb: bool | Literal["auto"]
    overwrite: bool  # replace an eval.json already in out (else refused before any decoding)


# -- report -----------------------------------------------------------------------------------
class ReportConfig(ConfigModel):
    """What `hydra-heads report` reads and writes (conf/report.yaml)."""

    runs: Annotated[
        list[str], check(bool, "one or more train / eval / sweep dirs, e.g. runs=[DIR,DIR]")
    ]
    out: str
    title: str
    sort_by: Literal[SORT_KEYS]  # type: ignore[valid-type]
    names: list[str] | None  # display names, one per run (default: from the dirs)
    plots: bool
    # auto: the CLI logs tables and plots into each run's own wandb run, if it had one
    wandb: bool | Literal["auto"]

    @model_validator(mode="after")
    def _names(self) -> ReportConfig:
        if self.names is not None and len(self.names) != len(self.runs):
            fail("names", self.names, f"one name per run ({len(self.runs)})")
        return self
