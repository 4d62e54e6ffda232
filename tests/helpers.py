"""Plain helpers the tests share (fixtures live in conftest.py): configs composed from conf/,
fixture chats, the CLI as a subprocess, perturbed heads, tree strategies, a SLURM probe."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import strategies as st

from train.core.config import compose, conf_dir, from_group, load
from train.decoding.decoder import Decoder
from train.decoding.propose import Proposal

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "hydra-heads")


# -- configs, as the CLI composes them ---------------------------------------------------------


def group_options(group: str) -> list[str]:
    """A config group's options; `_shared.yaml` holds keys the options share and is not one."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml") if not p.stem.startswith("_"))


def prep_config(overrides: list[str]):
    """A validated PrepConfig composed from conf/prep.yaml + overrides."""
    from data_prep.config import PrepConfig

    return load(compose("prep", overrides), PrepConfig)


def train_config(overrides: list[str]):
    """A validated TrainConfig composed from conf/train.yaml + overrides."""
    from train.config import TrainConfig

    return load(compose("train", overrides), TrainConfig)


def base_config(option: str = "tiny_random", **values):
    """conf/base/<option>.yaml with `values` replacing its keys (`_shared`: no option)."""
    from train.core.base import BaseConfig

    return from_group(BaseConfig, "base", option, **values)


def head_config(name: str, **values):
    """conf/head/<name>.yaml with `values` replacing its keys; errors name keys as `num_heads`."""
    from train.core.config import group_defaults
    from train.heads import HeadConfig

    return HeadConfig(**{**group_defaults("head", name), **values})


def report_config(runs: list[str], out: str, **values):
    """conf/report.yaml as a ReportConfig with `runs`, `out` and `values` set."""
    from omegaconf import OmegaConf

    from evaluation.config import ReportConfig

    data = OmegaConf.to_container(compose("report"))
    return ReportConfig(**{**data, "runs": runs, "out": out, **values})


def regen_config(**values):
    """conf/prep.yaml's `regen:` block as a RegenConfig with `values` set."""
    from data_prep.config import RegenConfig

    return RegenConfig(**{**prep_config(["out=unused"]).regen.model_dump(), **values})


# -- chat data ---------------------------------------------------------------------------------
def conv(*turns: tuple[str, str], cid: str | None = None) -> dict:
    """A ShareGPT record from (from, value) pairs."""
    rec = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    if cid is not None:
        rec["id"] = cid
    return rec


GOOD = [
    conv(("human", "What is 2+2?"), ("gpt", "2+2 is 4."), cid="good-1"),
    conv(
        ("system", "Be brief."),
        ("human", "Name a colour."),
        ("gpt", "Blue."),
        ("human", "Another?"),
        ("gpt", "Green."),
        cid="good-2",
    ),
    {
        "id": "good-3",
        "messages": [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
        ],
    },
    conv(("user", "Ciao"), ("chatgpt", "Ciao! Come va?"), cid="good-4"),
    conv(("human", "Search this"), ("bing", "Here is what I found."), cid="good-5"),
]

EXPECTED_SKIPS = {
    "empty": 1,
    "non_string_content": 1,
    "unknown_role": 1,
    "no_assistant_turn": 1,
    "invalid_json": 1,
    "bad_encoding": 1,
    "duplicate": 1,
    "non_alternating": 1,
    "not_an_object": 1,
    "no_conversation": 1,
}


def pattern_rows(n: int = 60) -> list[dict]:
    """Chats whose replies follow a learnable rule (counting), as ShareGPT records."""
    import random

    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, step = rng.randint(0, 9), rng.choice([1, 2, 3])
        reply = " ".join(str((a + step * j) % 10) for j in range(24))
        rows.append(
            conv(("human", f"count from {a} by {step}, take {i}"), ("gpt", reply), cid=f"p{i}")
        )
    return rows


# -- the CLI -------------------------------------------------------------------------------------
def run(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`hydra-heads <args>` as a user runs it (offline hub; wandb mode left to the CLI)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("WANDB_MODE", None)  # the CLI itself must pick offline mode without an API key
    return subprocess.run(
        [CLI, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def run_here(*args: str) -> subprocess.CompletedProcess:
    """`hydra-heads <args>` run by the CLI's own `main` in this process: the same argv parsing,
    hydra app, exit status and stdout / stderr text as `run`, without the ~5 s a new
    interpreter spends importing torch, transformers and lightning. For tests of what a
    command does, not of the process boundary (`run` stays for environment, signals, wandb,
    multi-process launchers and the CLI tests themselves). What the CLI changes process-wide
    (argv, __main__.__spec__, the environment, logging, warning filters, torch threads) is put
    back afterwards, so tests that follow see no trace of it."""
    import contextlib
    import io
    import logging
    import traceback
    import warnings

    import __main__
    from launch.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv, spec, env = sys.argv, getattr(__main__, "__spec__", None), dict(os.environ)
    threads = torch.get_num_threads()
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    log_state = [(lg, lg.level, lg.propagate, lg.disabled, lg.handlers[:]) for lg in loggers]
    code = 0
    try:
        with (
            warnings.catch_warnings(record=True) as caught,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                main(list(args))
            except SystemExit as e:  # as the interpreter reports it: None 0, a message 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001 - an uncaught error: traceback and status 1
                traceback.print_exc()
                code = 1
        for w in caught:  # onto its stderr, as the process would print them
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    finally:
        sys.argv = argv  # the CLI binds a new list: this is the untouched original
        __main__.__spec__ = spec
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
        for lg, level, propagate, disabled, handlers in log_state:
            lg.setLevel(level)
            lg.propagate, lg.disabled, lg.handlers[:] = propagate, disabled, handlers
    return subprocess.CompletedProcess([CLI, *args], code, out.getvalue(), err.getvalue())


def wide_console(monkeypatch, width: int = 300) -> None:
    """Rich consoles made from here on are `width` columns wide, so a printed table's rows do
    not wrap. Not COLUMNS: rich reads the os.environ it saw at import, and `datasets.map` with
    num_proc replaces os.environ with a copy, after which a set COLUMNS goes unseen."""
    from functools import partial

    import rich.console

    monkeypatch.setattr(rich.console, "Console", partial(rich.console.Console, width=width))


def slurm_up() -> bool:
    """A SLURM controller answers (CI starts one: launch/slurm/local_cluster_up.sh)."""
    if not shutil.which("sbatch"):
        return False
    r = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return "is UP" in r.stdout


# -- heads ---------------------------------------------------------------------------------------
def arch_shape(arch: str, num_heads: int, num_layers: int) -> dict:
    """Head-config sizes for a test of `arch`: the given ones, or one head of one layer for a
    recurrent head set (eagle-attn), whose config allows nothing else (EAGLE-3: up to 3
    unrolled steps)."""
    from train.heads import HEADS

    if HEADS[arch].recurrent:  # an unrolled set's num_heads: its training-time test steps
        return {"num_heads": min(num_heads, 3) if HEADS[arch].unrolled else 1, "num_layers": 1}
    return {"num_heads": num_heads, "num_layers": num_layers}


def feature_width(heads) -> int:
    """The width of what `heads` read from the base: H, or EAGLE-3's fused layers (n H)."""
    n = len(heads.features) if isinstance(heads.features, tuple) else 1
    return n * heads.hidden_size


def make_heads(model, arch: str, seed: int, scale: float, draft: int | None = None, **head):
    """Heads for `model` whose weights are the base lm_head copies plus N(0, scale) noise:
    fresh heads all echo the base's next token; noise makes every head its own."""
    from train.heads import base_shape, build_heads

    torch.manual_seed(seed)
    draft_ids = torch.randperm(model.config.vocab_size)[:draft].sort().values if draft else None
    head = {**arch_shape(arch, 4, 1), "draft_vocab_size": draft, **head}
    cfg = head_config(arch, **head)
    heads = build_heads(
        cfg, base_shape(model.config), model.get_output_embeddings().weight, draft_ids
    )
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * scale)
    return heads.eval()


@st.composite
def trees(draw, max_depth=4, max_nodes=30):
    """Random Medusa-format trees: every prefix of a path is a path, sibling ranks distinct."""
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(draw(st.integers(0, max_nodes))):
        parent = draw(st.sampled_from(frontier))
        used = {p[-1] for p in paths if p[:-1] == parent}
        rank = draw(st.integers(0, 6).filter(lambda r, used=used: r not in used))
        node = (*parent, rank)
        paths.append(node)
        if len(node) < max_depth:
            frontier.append(node)
    return [list(p) for p in paths]


class OracleDecoder(Decoder):
    """Proposes the true greedy continuation at chosen ranks of the tree, junk elsewhere: every
    step should then accept a whole root-to-leaf path, through non-zero ranks (batch 1)."""

    def __init__(self, *a, ref: list[int], prompt_len: int, true_path: list[int], **k):
        super().__init__(*a, **k)
        self.ref, self.prompt_len, self.true_path = ref, prompt_len, true_path

    def propose(self, ctx, roots, lengths, memory=None):
        at = int(lengths[0]) - self.prompt_len  # ref[at] is the root
        root = int(roots[0])
        assert self.ref[at] == root
        tokens = torch.empty(1, self.tree.num_nodes, dtype=torch.long, device=roots.device)
        tokens[0, 0] = root
        for i, p in enumerate(self.tree.paths, start=1):
            true = self.ref[at + len(p)] if at + len(p) < len(self.ref) else 0
            on_path = list(p) == self.true_path[: len(p)]
            tokens[0, i] = true if on_path else (true + 1 + i) % self.model.config.vocab_size
        prop = self.proposer
        return Proposal([self.tree], tokens, prop.bias, prop.depth)


def oracle_decode(model, heads, ids: list[int], true_path: list[int], new: int = 60):
    """(plain greedy tokens, the OracleDecoder's speculative Generation) on a [3, 2, 2] tree
    whose `true_path` ranks hold the true continuation."""
    from train.decoding.tree import Tree, branching

    ref = Decoder(model, set(), heads).plain([ids], new)[0].tokens
    tree = Tree.from_paths(branching([3, 2, 2]))
    dec = OracleDecoder(
        model, set(), heads, tree, ref=ref, prompt_len=len(ids), true_path=true_path
    )
    return ref, dec.speculative([ids], new)[0]


# -- head outputs the tests compare (production proposes through train/decoding/propose.py) -----
def full_vocab_logits(heads, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocab logits scattered into the full vocab (-inf for tokens outside it)."""
    if heads.draft is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], heads.vocab_size), float("-inf"))
    full[..., heads.draft.to_full] = logits
    return full


def head_step(heads, k: int, ctx: torch.Tensor, path_tokens: torch.Tensor, embed) -> torch.Tensor:
    """Full-vocab logits of head k (0-based) for N nodes: ctx (N, H), path_tokens (N, k+1) the
    tokens from the root down to each node (ignored by Medusa heads)."""
    path = embed(path_tokens) if heads.uses_path else None
    return full_vocab_logits(heads, heads.logits(k, heads.head_input(k, ctx, path)))


def propose_chain(heads, ctx: torch.Tensor, first_token: torch.Tensor, embed) -> torch.Tensor:
    """Greedy chain of K draft tokens after `first_token`: (N, K), head by head."""
    path = first_token[:, None]
    out = []
    for k in range(heads.num_heads):
        nxt = head_step(heads, k, ctx, path, embed).argmax(-1)
        out.append(nxt)
        path = torch.cat([path, nxt[:, None]], dim=1)
    return torch.stack(out, dim=1)


def random_one_layer_heads(tiny_base, name: str, seed: int = 0, **head):
    """A recurrent head set (eagle-attn, cross-attn) for tiny_base with random trainable
    weights (a near-identity fresh layer would hide wiring bugs); its lm head the base's."""
    from train.heads import base_shape, build_heads

    torch.manual_seed(seed)
    cfg = head_config(name, **head)
    heads = build_heads(cfg, base_shape(tiny_base.config), tiny_base.lm_head.weight)
    with torch.no_grad():
        for p in heads.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.1)
    return heads.eval()


def official_round_trip(tmp_path: Path, tiny_base, heads, official, arch: str) -> None:
    """A recurrent head set exported as format=hydra and loaded into `official`, a stand-in
    of zankner/Hydra's module (`load(state)`, `training_logits(ids, hidden)`,
    `chain_logits(ids, hidden, drafts)`, ids (T,), hidden (T, H)): the same logits in training
    (but the last position, which their roll wraps) and along a drafted chain of 4 (ours by
    calibration's unroll); imported back, the same heads, name for name."""
    import json

    from train.decoding.recurrent import unroll
    from train.export import export_heads, import_heads
    from train.heads import heads_meta, load_heads, save_heads

    tiny = base_config("tiny_random", name="tiny_random")
    meta = heads_meta(heads, tiny_base.fingerprint(), tiny.to_dict())
    hdir = save_heads(tmp_path / "run" / "heads", heads, meta)
    export_heads(hdir, "hydra", tmp_path / "x")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["hydra_head_arch"] == arch and cfg["grounded_heads"] is True
    assert cfg["hydra_num_heads"] == cfg["hydra_num_layers"] == 1
    official.load(torch.load(tmp_path / "x" / "hydra_lm_head.pt", weights_only=True))
    torch.manual_seed(5)
    ids = torch.randint(0, tiny_base.vocab_size, (10,))
    hidden = torch.randn(10, heads.hidden_size)
    embed = tiny_base.embed_tokens
    with torch.no_grad():
        ours = heads.logits(0, heads(hidden[None], embed(ids)[None])[0])[0]
        assert torch.allclose(ours[:-1], official.training_logits(ids, hidden)[:-1], atol=1e-4)
        drafts = [int(x) for x in torch.randint(0, tiny_base.vocab_size, (4,))]
        path = torch.cat([ids, torch.tensor(drafts)])
        pad = torch.zeros(4, heads.hidden_size)
        chain = unroll(heads, torch.cat([hidden, pad]), path, embed, 4)
        got = torch.stack([heads.logits(0, chain[d][0, 9]) for d in range(4)])
        assert torch.allclose(got, official.chain_logits(ids, hidden, drafts), atol=1e-4)
    import_heads(tmp_path / "x", "hydra", tiny, tmp_path / "back")
    back, _ = load_heads(tmp_path / "back", tiny_base.fingerprint())
    assert back.arch == heads.arch
    for (n, a), (m, b) in zip(heads.state_dict().items(), back.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
