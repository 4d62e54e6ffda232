"""Export / import of heads (hf, hydra, medusa): exact round trips, their layouts, refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.helpers import base_config, full_vocab_logits, head_config, head_step, run
from train.core.checkpoint import FORMAT, HeadsMismatchError
from train.core.errors import ConfigError
from train.decoding.propose import candidates
from train.export import FormatError, export_heads, import_heads
from train.heads import base_shape, build_heads, heads_meta, load_heads, save_heads

TINY = base_config("tiny_random", name="tiny_random")


def make(
    tmp: Path, tiny_base, arch: str, *, draft=None, layers=1, offset=0, tie=False, seed=0, **head
):
    """Perturbed heads saved as `hydra-heads train` saves them: (heads, heads dir)."""
    torch.manual_seed(seed)
    ids = torch.randperm(tiny_base.vocab_size)[:draft].sort().values if draft else None
    cfg = head_config(
        arch,
        num_heads=3,
        num_layers=layers,
        draft_vocab_size=draft,
        hidden_state_offset=offset,
        **{"tie_blocks": False, "bias": False, **head},
    )
    heads = build_heads(cfg, base_shape(tiny_base.config), tiny_base.lm_head.weight, ids)
    with torch.no_grad():  # fresh heads all echo the base; noise makes every head its own
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        if tie:  # what zankner/Hydra can hold: the blocks its HydraMLP shares are equal
            first = 0 if arch == "medusa" else 1
            for mlp in heads.mlps:
                for block in list(mlp)[first + 1 :]:
                    block.load_state_dict(mlp[first].state_dict())
    meta = heads_meta(heads, tiny_base.fingerprint(), TINY.to_dict())
    meta["training"] = {"steps": 7, "prepared": "/data/p"}
    return heads.eval(), save_heads(tmp / f"{arch}-{draft}-{layers}" / "heads", heads, meta)


def assert_same_proposals(a, b, embed: nn.Module) -> None:
    """Same states, logits and top-k candidates on random contexts and tree paths."""
    g = torch.Generator().manual_seed(1)
    h = a.hidden_size
    hidden, emb = torch.randn(2, 7, h, generator=g), torch.randn(2, 7, h, generator=g)
    for x, y in zip(a(hidden, emb), b(hidden, emb), strict=True):
        assert torch.equal(x, y)
    ctx = torch.randn(6, h, generator=g)
    for k in range(a.num_heads):
        path = torch.randint(0, a.vocab_size, (6, k + 1), generator=g)
        assert torch.equal(head_step(a, k, ctx, path, embed), head_step(b, k, ctx, path, embed))
        assert torch.equal(
            candidates(a, k, ctx, path, embed, 5), candidates(b, k, ctx, path, embed, 5)
        )


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fmt", "arch", "draft", "layers", "tie"),
    [
        ("hf", "hydra_pp", 50, 2, False),
        ("hf", "medusa", None, 1, False),
        ("hydra", "hydra", None, 2, False),  # grounded, every block its own weights there
        ("hydra", "hydra", None, 3, True),  # blocks 1..2 are one shared ResBlock there
        ("hydra", "medusa", None, 1, False),  # ungrounded hydra_head_arch=mlp
        ("hydra", "hydra_pp", None, 3, True),  # hydra_head_arch=prefix-mlp (Hydra++)
        ("medusa", "medusa", None, 2, False),
        ("medusa", "medusa", 50, 1, False),  # vLLM truncated vocab + token_map
    ],
)
def test_export_import_round_trip_keeps_proposals(
    tmp_path, tiny_base, fmt, arch, draft, layers, tie
):
    heads, hdir = make(tmp_path, tiny_base, arch, draft=draft, layers=layers, tie=tie)
    export_heads(hdir, fmt, tmp_path / "x")
    res = import_heads(tmp_path / "x", fmt, None if fmt == "hf" else TINY, tmp_path / "back")
    assert (res["arch"], res["num_layers"], res["draft_vocab_size"]) == (arch, layers, draft)
    back, meta = load_heads(tmp_path / "back", tiny_base.fingerprint())
    assert meta["imported"]["format"] == fmt and meta["base"]["config"]["name"] == "tiny_random"
    assert back.state_dict().keys() == heads.state_dict().keys()
    assert_same_proposals(heads, back, tiny_base.embed_tokens)


def test_hf_export_is_a_heads_checkpoint_with_a_model_card(tmp_path, tiny_base):
    heads, hdir = make(tmp_path, tiny_base, "hydra_pp", draft=40)
    ev = {
        "heads": str(hdir),
        "arch": "hydra_pp",
        "num_heads": 3,
        "tau": 2.4567,
        "speedup": 1.8321,
        "tau_ci95": [2.31, 2.6],
        "acceptance_cumulative": [0.8, 0.5, 0.25],
        "acceptance_conditional": [0.8, 0.625, 0.5],
        "tree": {"kind": "calibrated", "num_nodes": 12, "depth": 3},
        "prompts": {"items": 8, "generations": 9},
        "sampling": {"temperature": 0.0, "acceptance": "greedy"},
        "lossless": True,
    }
    (hdir.parent / "eval").mkdir()
    (hdir.parent / "eval" / "eval.json").write_text(json.dumps(ev))  # found beside the run
    res = export_heads(hdir, "hf", tmp_path / "hf", base_model="HuggingFaceTB/SmolLM2-135M")
    out = tmp_path / "hf"
    assert res["files"] == [
        "README.md",
        "config.json",
        "heads.safetensors",
        "heads_config.json",
        "model.safetensors",
    ]
    assert "(found)" in res["notes"][0]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["HydraPPHeads"] and cfg["format"] == FORMAT
    assert cfg["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M"
    assert (out / "model.safetensors").read_bytes() == (hdir / "heads.safetensors").read_bytes()
    assert (out / "heads.safetensors").read_bytes() == (hdir / "heads.safetensors").read_bytes()
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M" in card
    assert "| tau (tokens per base forward) | 2.457 (95% CI 2.310-2.600) |" in card
    assert "| speedup vs plain decoding | 1.832x |" in card  # no interval in this eval.json
    assert "| 3 | 0.250 | 0.500 |" in card and "12 nodes, depth 3" in card
    assert "40 most frequent" in card
    # our own eval's loader reads the directory as it is
    loaded, meta = load_heads(out, tiny_base.fingerprint())
    assert meta["training"]["steps"] == 7
    assert_same_proposals(heads, loaded, tiny_base.embed_tokens)
    # and an import keeps what training recorded
    import_heads(out, "hf", None, tmp_path / "back")
    _, back_meta = load_heads(tmp_path / "back")
    assert back_meta["training"] == meta["training"]
    assert {k: v for k, v in back_meta.items() if k != "imported"} == meta


def test_model_card_takes_only_an_eval_of_these_heads(tmp_path, tiny_base):
    heads, hdir = make(tmp_path, tiny_base, "medusa")
    other = {"heads": "/elsewhere/heads", "arch": "medusa", "num_heads": 3, "tau": 9.0}
    (hdir.parent / "eval.json").write_text(json.dumps(other))
    res = export_heads(hdir, "hf", tmp_path / "hf")
    assert "no eval.json" in res["notes"][0]
    assert "No evaluation figures" in (tmp_path / "hf" / "README.md").read_text()
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**other, "arch": "hydra"}))
    with pytest.raises(ConfigError, match="'eval'.*evaluates 3 hydra heads"):
        export_heads(hdir, "hf", tmp_path / "hf2", eval_json=wrong)


# -- their layouts, run by stand-ins written from their code's structure -------------------
class ZanknerResBlock(nn.Module):
    """zankner/Hydra's ResBlock: res_connection(x) + SiLU(linear(x)), both linears biased."""

    def __init__(self, h: int, num_condition: int = 0):
        super().__init__()
        self.linear = nn.Linear(h * (num_condition + 1), h)
        self.res_connection = (
            nn.Linear(h * (num_condition + 1), h) if num_condition else nn.Identity()
        )

    def forward(self, x):
        return self.res_connection(x) + nn.functional.silu(self.linear(x))


class ZanknerHydraMLP(nn.Module):
    """The module layout of zankner/Hydra's HydraMLP (hydra_head_arch=mlp)."""

    def __init__(self, h: int, v: int, heads: int, layers: int, grounded: bool, embed):
        super().__init__()
        self.grounded = grounded
        if grounded:  # list repetition: one ResBlock object repeated, as in their code
            mlps = [
                nn.Sequential(ZanknerResBlock(h, k + 1), *([ZanknerResBlock(h)] * (layers - 1)))
                for k in range(heads)
            ]
        else:
            mlps = [nn.Sequential(*([ZanknerResBlock(h)] * layers)) for _ in range(heads)]
        self.hydra_mlp = nn.ModuleList(mlps)
        self.hydra_lm_head = nn.ModuleList(nn.Linear(h, v) for _ in range(heads))
        self.input_embed_fn = embed  # a submodule there too: its weight is in their state dict

    def logits(self, k: int, ctx, path_tokens):
        x = ctx
        if self.grounded:
            x = torch.cat([ctx, self.input_embed_fn(path_tokens).flatten(-2)], dim=-1)
        return self.hydra_lm_head[k](self.hydra_mlp[k](x))


@pytest.mark.parametrize(("arch", "layers"), [("hydra", 3), ("medusa", 2)])
def test_hydra_export_loads_into_zankner_hydra_layout(tmp_path, tiny_base, arch, layers):
    heads, hdir = make(tmp_path, tiny_base, arch, layers=layers, tie=True, offset=1)
    export_heads(hdir, "hydra", tmp_path / "x", base_model="lmsys/vicuna-7b-v1.3")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg == {
        "hydra_num_heads": 3,
        "hydra_num_layers": layers,
        "hydra_head_arch": "mlp",
        "grounded_heads": arch == "hydra",
        "hidden_state_offset": 1,
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
    }
    theirs = ZanknerHydraMLP(
        64, tiny_base.vocab_size, 3, layers, arch == "hydra", tiny_base.embed_tokens
    )
    state = torch.load(tmp_path / "x" / "hydra_lm_head.pt", weights_only=True)
    # their loader is non-strict; only the base embedding may be missing, nothing left over
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert missing == ["input_embed_fn.weight"] and unexpected == []
    ctx = torch.randn(5, 64)
    for k in range(3):
        path = torch.randint(0, tiny_base.vocab_size, (5, k + 1))
        with torch.no_grad():
            want = head_step(heads, k, ctx, path, tiny_base.embed_tokens)
            got = theirs.logits(k, ctx, path)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.topk(5).indices, want.topk(5).indices)


class ZanknerHydraPrefixMLP(nn.Module):
    """The module layout of zankner/Hydra's HydraPrefixMLP (hydra_head_arch=prefix-mlp,
    grounded): a one-layer transformers LlamaModel (its final norm included) over the base
    hidden states, `[Dropout, ResBlock] * (L-1)` after a first ResBlock, lm heads as
    `Sequential(Dropout, Linear)` with biases; their forward, teacher-forced with torch.roll."""

    def __init__(self, base_config, heads: int, layers: int, embed):
        from transformers import LlamaModel

        super().__init__()
        config = copy.deepcopy(base_config)
        config.num_hidden_layers = 1
        config._attn_implementation = "sdpa"
        self.prefix_embeding_layer = LlamaModel(config)
        h, v = config.hidden_size, config.vocab_size
        drop = nn.Dropout(0.2)  # list repetition: the same modules repeated, as in their code
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(
                drop, ZanknerResBlock(h, k + 1), *([drop, ZanknerResBlock(h)] * (layers - 1))
            )
            for k in range(heads)
        )
        self.hydra_lm_head = nn.ModuleList(
            nn.Sequential(nn.Dropout(0.2), nn.Linear(h, v)) for _ in range(heads)
        )
        self.input_embed_fn = embed

    def forward(self, base_hidden_states, input_ids):
        prefix = self.prefix_embeding_layer(inputs_embeds=base_hidden_states)[0]
        embeds = self.input_embed_fn(input_ids)
        inputs = [prefix] + [
            torch.roll(embeds, shifts=-(i + 1), dims=1) for i in range(len(self.hydra_mlp))
        ]
        return [
            self.hydra_lm_head[i](self.hydra_mlp[i](torch.cat(inputs[: i + 2], dim=-1)))
            for i in range(len(self.hydra_mlp))
        ]


def _compare_with_prefix_mlp(ours, theirs, tiny_base) -> float:
    """Teacher-forced logits at every position whose path lies inside the sequence (their
    torch.roll wraps around past the end, our path is zeros there) and tree step() logits at
    one position: the largest absolute difference."""
    ours.eval(), theirs.eval()
    T = 11
    torch.manual_seed(3)
    ids = torch.randint(0, tiny_base.vocab_size, (2, T))
    hidden = torch.randn(2, T, 64)
    worst = 0.0
    with torch.no_grad():
        states = ours(hidden, tiny_base.embed_tokens(ids))
        want = theirs(hidden, ids)
        ctx = ours.context(hidden)
        for k in range(ours.num_heads):
            valid = T - k - 1  # positions t whose path x_{t+1..t+k+1} is inside
            got = full_vocab_logits(ours, ours.logits(k, states[k]))[:, :valid]
            torch.testing.assert_close(got, want[k][:, :valid], rtol=1e-4, atol=1e-4)
            worst = max(worst, float((got - want[k][:, :valid]).abs().max()))
            t = 4
            step = head_step(ours, k, ctx[:, t], ids[:, t + 1 : t + k + 2], tiny_base.embed_tokens)
            torch.testing.assert_close(step, want[k][:, t], rtol=1e-4, atol=1e-4)
            worst = max(worst, float((step - want[k][:, t]).abs().max()))
    return worst


def test_hydra_pp_export_loads_into_the_official_prefix_mlp(tmp_path, tiny_base):
    heads, hdir = make(tmp_path, tiny_base, "hydra_pp", layers=3, tie_blocks=True, bias=True)
    export_heads(hdir, "hydra", tmp_path / "x", base_model="lmsys/vicuna-7b-v1.3")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["hydra_head_arch"] == "prefix-mlp" and cfg["grounded_heads"] is True
    assert (cfg["hydra_num_heads"], cfg["hydra_num_layers"]) == (3, 3)
    theirs = ZanknerHydraPrefixMLP(tiny_base.config, 3, 3, tiny_base.embed_tokens)
    state = torch.load(tmp_path / "x" / "hydra_lm_head.pt", weights_only=True)
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    # only the base's embeddings (theirs by reference) and the prefix's unused table are absent
    assert sorted(missing) == ["input_embed_fn.weight", "prefix_embeding_layer.embed_tokens.weight"]
    assert unexpected == []
    assert _compare_with_prefix_mlp(heads, theirs, tiny_base) < 1e-4


@pytest.mark.parametrize("arch", ["hydra_pp", "hydra", "medusa"])
def test_default_heads_are_the_official_structure_and_export(tmp_path, tiny_base, arch):
    """head=<arch> with its defaults is zankner/Hydra's module: the H -> H blocks are one
    module (a 4-block default Hydra++ exports with format=hydra), with biases where the
    official heads have them."""
    cfg = head_config(arch, num_heads=2, num_layers=3)
    assert cfg.tie_blocks is True and cfg.bias is (arch != "medusa")
    torch.manual_seed(3)
    heads = build_heads(cfg, base_shape(tiny_base.config), tiny_base.lm_head.weight, None)
    with torch.no_grad():  # perturb as training would: the tied blocks stay one tensor each
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    first = 0 if arch == "medusa" else 1
    assert all(b is mlp[first] for mlp in heads.mlps for b in list(mlp)[first + 1 :])
    meta = heads_meta(heads, tiny_base.fingerprint(), TINY.to_dict())
    hdir = save_heads(tmp_path / "heads", heads, meta)
    export_heads(hdir, "hydra", tmp_path / "x", base_model="lmsys/vicuna-7b-v1.3")
    import_heads(tmp_path / "x", "hydra", TINY, tmp_path / "back")
    back, _ = load_heads(tmp_path / "back", tiny_base.fingerprint())
    assert_same_proposals(heads.eval(), back.eval(), tiny_base.embed_tokens)


def test_official_prefix_mlp_checkpoint_imports_exactly(tmp_path, tiny_base):
    torch.manual_seed(7)
    theirs = ZanknerHydraPrefixMLP(tiny_base.config, 4, 4, tiny_base.embed_tokens)
    with torch.no_grad():  # their init leaves linear weights at zero: make every tensor count
        for p in theirs.parameters():
            if p is not tiny_base.embed_tokens.weight:
                p.add_(torch.randn_like(p) * 0.05)
    src = tmp_path / "official"
    src.mkdir()
    state = theirs.state_dict()
    # what transformers 4.36 (their pin) also saved: the rotary buffer, ignored on import
    state["prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    torch.save(state, src / "hydra_lm_head.pt")
    cfg = {"hydra_num_heads": 4, "hydra_num_layers": 4, "hydra_head_arch": "prefix-mlp"}
    (src / "config.json").write_text(json.dumps({**cfg, "grounded_heads": True}))
    res = import_heads(src, "hydra", TINY, tmp_path / "ours")
    assert (res["arch"], res["num_heads"], res["num_layers"]) == ("hydra_pp", 4, 4)
    ours, meta = load_heads(tmp_path / "ours", tiny_base.fingerprint())
    assert meta["head"]["tie_blocks"] is True and meta["head"]["bias"] is True
    worst = _compare_with_prefix_mlp(ours, theirs, tiny_base)
    print(f"official prefix-mlp import: max abs logit difference {worst:.2e}")
    assert worst < 1e-4
    # and back out: the same tensors under the same names
    export_heads(tmp_path / "ours", "hydra", tmp_path / "again")
    again = torch.load(tmp_path / "again" / "hydra_lm_head.pt", weights_only=True)
    ignored = {"input_embed_fn.weight", "prefix_embeding_layer.embed_tokens.weight"}
    ignored |= {n for n in state if n.endswith("rotary_emb.inv_freq")}
    assert set(again) == set(state) - ignored  # every tensor they read comes back
    for name, t in again.items():
        assert torch.equal(t, state[name]), name


class VllmResidualBlock(nn.Module):
    """vLLM's Medusa ResidualBlock: x = x + SiLU(layer(x)) per layer (medusa_fc_bias=true)."""

    def __init__(self, h: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(h, h, bias=True) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class FasterDecodingResBlock(nn.Module):
    """FasterDecoding/Medusa's ResBlock (TensorRT-LLM's MedusaLayer): x + SiLU(linear(x))."""

    def __init__(self, h: int):
        super().__init__()
        self.linear = nn.Linear(h, h)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


@pytest.mark.parametrize("draft", [None, 50])
def test_medusa_export_loads_into_vllm_and_tensorrt_llm_layouts(tmp_path, tiny_base, draft):
    heads, hdir = make(tmp_path, tiny_base, "medusa", draft=draft, layers=2)
    export_heads(hdir, "medusa", tmp_path / "x")
    out = tmp_path / "x"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"]) == (3, 2, 64)
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 2)
    assert cfg["vocab_size"] == tiny_base.vocab_size and cfg["medusa_fc_bias"] is True
    assert cfg.get("truncated_vocab_size") == draft
    rows = draft or tiny_base.vocab_size
    vllm = nn.Module()
    vllm.blocks = nn.ModuleList(VllmResidualBlock(64, 2) for _ in range(3))
    vllm.lm_heads = nn.ModuleList(nn.Linear(64, rows, bias=False) for _ in range(3))
    state = load_file(str(out / "model.safetensors"))
    token_map = state.pop("token_map", None)
    assert (token_map is not None) == (draft is not None)
    vllm.load_state_dict(state, strict=True)
    ctx = torch.randn(5, 64)
    for k in range(3):
        want = head_step(
            heads, k, ctx, torch.zeros(5, k + 1, dtype=torch.long), tiny_base.embed_tokens
        )
        with torch.no_grad():
            logits = vllm.lm_heads[k](vllm.blocks[k](ctx))
        if token_map is not None:  # vLLM scatters draft logits into the full vocab like this
            full = torch.full((5, tiny_base.vocab_size), float("-inf"))
            full[:, token_map] = logits
            logits = full
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))
    trt = out / "medusa_lm_head.safetensors"
    assert trt.is_file() == (draft is None)  # TensorRT-LLM has no draft vocab
    if draft is None:  # FasterDecoding/Medusa names, which TensorRT-LLM reads
        fd = nn.ModuleList(
            nn.Sequential(
                FasterDecodingResBlock(64),
                FasterDecodingResBlock(64),
                nn.Linear(64, rows, bias=False),
            )
            for _ in range(3)
        )
        fd.load_state_dict(load_file(str(trt)), strict=True)
        for k in range(3):
            want = head_step(
                heads, k, ctx, torch.zeros(5, k + 1, dtype=torch.long), tiny_base.embed_tokens
            )
            with torch.no_grad():
                torch.testing.assert_close(fd[k](ctx), want, rtol=1e-5, atol=1e-5)


def test_import_reads_fasterdecoding_medusa_pt(tmp_path, tiny_base):
    heads, hdir = make(tmp_path, tiny_base, "medusa", layers=1)
    export_heads(hdir, "medusa", tmp_path / "x")
    src = tmp_path / "fd"
    src.mkdir()
    state = load_file(str(tmp_path / "x" / "medusa_lm_head.safetensors"))
    torch.save(state, src / "medusa_lm_head.pt")
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    import_heads(src, "medusa", TINY, tmp_path / "back")
    back, _ = load_heads(tmp_path / "back", tiny_base.fingerprint())
    assert_same_proposals(heads, back, tiny_base.embed_tokens)


# -- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("arch", "kw", "fmt", "message"),
    [
        ("hydra", {}, "medusa", "no engine runs sequentially dependent heads"),
        ("hydra_pp", {}, "medusa", "no engine runs sequentially dependent heads"),
        ("hydra", {"draft": 40}, "hydra", "draft vocab (draft_vocab_size=40)"),
        ("hydra_pp", {"draft": 40}, "hydra", "draft vocab (draft_vocab_size=40)"),
        ("hydra_pp", {"layers": 3}, "hydra", "block 2 of head 0 differs from block 1"),
        ("medusa", {"draft": 40}, "hydra", "score the full vocab"),
        ("hydra", {"layers": 3}, "hydra", "block 2 of head 0 differs from block 1"),
        ("medusa", {"layers": 2}, "hydra", "block 1 of head 0 differs from block 0"),
        ("medusa", {"offset": 1}, "medusa", "last (post-norm) hidden state"),
    ],
)
def test_unsupported_exports_are_refused_clearly(tmp_path, tiny_base, arch, kw, fmt, message):
    _, hdir = make(tmp_path, tiny_base, arch, **kw)
    with pytest.raises(FormatError, match=r"cannot be exported as format=" + fmt) as e:
        export_heads(hdir, fmt, tmp_path / "x")
    assert message in str(e.value) and "format=hf" in str(e.value)
    assert not (tmp_path / "x").exists()


def test_import_refuses_what_our_heads_cannot_hold(tmp_path, tiny_base):
    _, hdir = make(tmp_path, tiny_base, "hydra", layers=1)
    export_heads(hdir, "hydra", tmp_path / "x")
    pt = tmp_path / "x" / "hydra_lm_head.pt"
    state = torch.load(pt, weights_only=True)
    state["hydra_mlp.0.7.linear.weight"] = torch.zeros(1)
    torch.save(state, pt)
    with pytest.raises(FormatError, match=r"no place for: hydra_mlp.0.7.linear.weight"):
        import_heads(tmp_path / "x", "hydra", TINY, tmp_path / "back")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    for arch, grounded in (("prefix-mlp", False), ("cross-attn", False), ("moe-mlp", True)):
        (tmp_path / "x" / "config.json").write_text(
            json.dumps({**cfg, "hydra_head_arch": arch, "grounded_heads": grounded})
        )
        with pytest.raises(FormatError, match=f"'{arch}', grounded_heads = .* cannot be imported"):
            import_heads(tmp_path / "x", "hydra", TINY, tmp_path / "back")
    # a cross-attn config over an mlp checkpoint: its sizes, then its tensors, are not theirs
    bad = {**cfg, "hydra_head_arch": "cross-attn"}
    (tmp_path / "x" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError, match="hydra_num_heads = 3 for cross-attn, whose module"):
        import_heads(tmp_path / "x", "hydra", TINY, tmp_path / "back")
    bad.update(hydra_num_heads=1, hydra_num_layers=1)
    (tmp_path / "x" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError, match="cross_attn.q_proj.weight"):
        import_heads(tmp_path / "x", "hydra", TINY, tmp_path / "back")
    with pytest.raises(FormatError, match="is not a hydra-heads hf export"):
        import_heads(tmp_path / "x", "hf", TINY, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_import_onto_another_base_names_both_shapes(tmp_path):
    src = tmp_path / "vllm"
    src.mkdir()
    h, v = 32, 259
    state = {"blocks.0.layers.0.weight": torch.zeros(h, h), "lm_heads.0.weight": torch.zeros(v, h)}
    save_file(state, str(src / "model.safetensors"))
    cfg = {"num_heads": 1, "num_hidden_layers": 1, "hidden_size": h, "vocab_size": v}
    (src / "config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "org/other"}))
    with pytest.raises(HeadsMismatchError) as e:
        import_heads(src, "medusa", TINY, tmp_path / "back")
    msg = str(e.value)
    assert "hidden_size=32, vocab_size=259 (org/other)" in msg
    assert "hidden_size=64, vocab_size=259" in msg


def test_out_is_never_an_input_or_silently_replaced(tmp_path, tiny_base):
    _, hdir = make(tmp_path, tiny_base, "medusa")
    with pytest.raises(ConfigError, match="'out'.*would replace the input"):
        export_heads(hdir, "hf", hdir.parent, overwrite=True)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("")
    with pytest.raises(FileExistsError, match="overwrite=true"):
        export_heads(hdir, "medusa", tmp_path / "x")
    export_heads(hdir, "medusa", tmp_path / "x", overwrite=True)
    assert not (tmp_path / "x" / "keep").exists()


# -- the real commands ---------------------------------------------------------------------
def test_cli_export_import_and_refusals(tmp_path, tiny_base):
    heads, hdir = make(tmp_path, tiny_base, "medusa", draft=50)
    r = run("export", f"heads={hdir}", "format=medusa", f"out={tmp_path / 'm'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported medusa heads as format=medusa" in r.stdout and "token_map" in r.stdout
    r = run(
        "import",
        f"src={tmp_path / 'm'}",
        "format=medusa",
        "base=tiny_random",
        f"out={tmp_path / 'i'}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "imported 3 x 1 medusa heads (draft vocab 50)" in r.stdout
    back, _ = load_heads(tmp_path / "i", tiny_base.fingerprint())
    assert_same_proposals(heads, back, tiny_base.embed_tokens)

    _, hydra_dir = make(tmp_path, tiny_base, "hydra")
    r = run("export", f"heads={hydra_dir}", "format=medusa", f"out={tmp_path / 'bad'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "no engine runs sequentially dependent heads" in r.stderr
    r = run("import", f"src={tmp_path / 'm'}", "format=medusa", f"out={tmp_path / 'i2'}")
    assert r.returncode == 2 and "'base'" in r.stderr and "pass base=NAME" in r.stderr
    assert not (tmp_path / "bad").exists() and not (tmp_path / "i2").exists()


@pytest.mark.parametrize(("grounded", "layers"), [(True, 2), (False, 1)])
def test_import_of_a_zankner_checkpoint_with_trained_biases(tmp_path, tiny_base, grounded, layers):
    """What their training leaves: every nn.Linear with a (random, then trained) bias. It
    imports as head.bias=true heads that propose exactly what their HydraMLP proposes, and
    exports back to the same tensors."""
    torch.manual_seed(3)
    theirs = ZanknerHydraMLP(64, tiny_base.vocab_size, 3, layers, grounded, tiny_base.embed_tokens)
    src = tmp_path / "zankner"
    src.mkdir()
    state = {k: v for k, v in theirs.state_dict().items() if k != "input_embed_fn.weight"}
    torch.save(state, src / "hydra_lm_head.pt")
    (src / "config.json").write_text(json.dumps({
        "hydra_num_heads": 3, "hydra_num_layers": layers, "hydra_head_arch": "mlp",
        "grounded_heads": grounded, "hidden_state_offset": 0,
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
    }))  # fmt: skip
    import_heads(src, "hydra", TINY, tmp_path / "ours")
    from train.heads import load_heads

    ours, meta = load_heads(tmp_path / "ours", tiny_base.fingerprint())
    assert meta["head"]["bias"] is True and ours.arch == ("hydra" if grounded else "medusa")
    ctx = torch.randn(5, 64)
    for k in range(3):
        path = torch.randint(0, tiny_base.vocab_size, (5, k + 1))
        with torch.no_grad():
            want = theirs.logits(k, ctx, path)
            got = head_step(ours, k, ctx, path, tiny_base.embed_tokens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    export_heads(tmp_path / "ours", "hydra", tmp_path / "again")
    again = torch.load(tmp_path / "again" / "hydra_lm_head.pt", weights_only=True)
    assert again.keys() == state.keys()
    assert all(torch.equal(again[k], state[k]) for k in state)
    if not grounded:  # vLLM's Medusa lm heads have no bias: refused, not silently dropped
        with pytest.raises(FormatError, match="head.bias=true cannot be exported as format=medusa"):
            export_heads(tmp_path / "ours", "medusa", tmp_path / "m")
