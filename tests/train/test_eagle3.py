"""EAGLE-3 (head=eagle3): its config, the fused layers it reads, training-time test against
drafting, and format=eagle3 / speculators loaded into stand-ins built to what SGLang and vLLM
document (names, config fields, d2t), with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tests.helpers import base_config, head_config, random_one_layer_heads, train_config
from train.core.errors import ConfigError
from train.decoding.backend import head_features
from train.decoding.recurrent import unroll
from train.heads import base_shape, build_heads
from train.heads.eagle3 import default_aux_layers


def test_config_names_what_eagle3_allows():
    assert head_config("eagle3", num_heads=7).num_heads == 7  # its training-time test steps
    for key, value in (("num_layers", 2), ("dropout", 0.1), ("bias", True)):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            head_config("eagle3", **{key: value})
    with pytest.raises(ConfigError, match="only eagle3 fuses layers"):
        head_config("hydra", aux_layers=[1, 2, 3])
    with pytest.raises(ConfigError, match="increasing layer indices"):
        head_config("eagle3", aux_layers=[27, 2, 15])  # the engines feed fc in layer order
    with pytest.raises(ConfigError, match="eagle3 reads aux_layers"):
        head_config("eagle3", hidden_state_offset=1)


def test_a_fresh_eagle3_draft_is_the_lm_head_on_its_high_layer(tiny_base):
    """init=ours: fc passes the highest fused layer through and the layer's attention and MLP
    outputs start at zero, so every unrolled step's state is that layer, normalised, scored by
    the base's lm_head rows."""
    heads = build_heads(
        head_config("eagle3", num_heads=2, init="ours"),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
    )
    feats = torch.randn(2, 7, 3 * 64)
    high = feats[..., -64:]
    want = high * torch.rsqrt(high.pow(2).mean(-1, keepdim=True) + 1e-6)
    for s in heads(feats, torch.randn(2, 7, 64)):
        assert torch.allclose(s, want, atol=1e-5)
    assert torch.equal(heads.lm_heads[0].weight, tiny_base.lm_head.weight)


def _train_cfg(prepared, tmp_path, *extra):
    return train_config(
        [
            "base=tiny_random",
            "head=eagle3",
            "head.num_heads=2",
            f"data.prepared={prepared}",
            f"out={tmp_path / 'run'}",
            "logger=none",
            "trainer.max_steps=5",
            "data.batch_size=4",
            *extra,
        ]
    )


def test_offline_eagle3_reads_its_layers_cached_by_prep(tiny_prepared, tmp_path):
    """Prepared data without the fused layers is refused with the command that adds them;
    `prep from_prepared=... cache_aux_layers=[...]` keeps the samples and caches the layers;
    offline training on them computes online training's loss (up to fp16 rounding)."""
    from data_prep.prepare import PrepError, prepare
    from tests.helpers import prep_config
    from train.data import PreparedDataError
    from train.recipe import build_module

    with pytest.raises(PrepError, match="prepared for base=tiny_random, not smollm2_135m"):
        prepare(prep_config([
            "base=smollm2_135m", f"from_prepared={tiny_prepared}", "cache_hidden=true",
            f"out={tmp_path / 'other'}",
        ]))  # fmt: skip
    with pytest.raises(PreparedDataError, match="from_prepared=.*cache_aux_layers") as e:
        build_module(_train_cfg(tiny_prepared, tmp_path, "data.offline=true"))
    assert "holds none" in str(e.value)
    layers = list(default_aux_layers(2))  # the tiny base's 2 layers: [1, 1, 0]
    out = tmp_path / "aux"
    stats = prepare(prep_config([
        "base=tiny_random", f"from_prepared={tiny_prepared}", "cache_hidden=true",
        f"cache_aux_layers={json.dumps(layers)}", f"out={out}",
    ]))  # fmt: skip
    assert stats["cached_aux_layers"] == layers and stats["from_prepared"]
    src = json.loads((tiny_prepared / "prep_stats.json").read_text())
    assert stats["splits"] == src["splits"]  # the same samples
    online, dm, *_ = build_module(_train_cfg(out, tmp_path))
    offline, dm_off, *_ = build_module(_train_cfg(out, tmp_path, "data.offline=true"))
    offline.heads.load_state_dict(online.heads.state_dict())
    dm.setup()
    dm_off.setup()
    b_on, b_off = next(iter(dm.train_dataloader())), next(iter(dm_off.train_dataloader()))
    assert b_off["aux_hidden"].shape[-1] == 3 * 64
    loss_on, _ = online.compute(b_on)
    loss_off, _ = offline.compute(b_off)
    assert torch.allclose(loss_on, loss_off, rtol=2e-3, atol=1e-4)
    with pytest.raises(PreparedDataError, match=r"holds \[1, 1, 0\]"):
        build_module(_train_cfg(out, tmp_path, "data.offline=true", "head.aux_layers=[0,1]"))


def _llama(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    c = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=200)  # fmt: skip
    return LlamaForCausalLM(c).eval()


def test_it_fuses_the_inputs_of_layers_2_n_half_and_n_minus_3():
    """EAGLE-3 (and vLLM, SGLang) capture the residual stream before layers 2, N // 2, N - 3;
    ours reads transformers' hidden_states at those indices: the same tensors, in that order."""
    model = _llama(8)
    heads = build_heads(head_config("eagle3"), base_shape(model.config), model.lm_head.weight)
    assert heads.features == (2, 4, 5) == default_aux_layers(8)
    seen = {}

    def keep(i):
        def hook(module, args, kwargs):
            seen[i] = args[0] if args else kwargs["hidden_states"]  # what enters layer i

        return hook

    hooks = [
        layer.register_forward_pre_hook(keep(i), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)
    ]
    ids = torch.randint(0, 200, (1, 7))
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    want = torch.cat([seen[2], seen[4], seen[5]], dim=-1)
    assert torch.equal(head_features(out, heads.features), want)
    with pytest.raises(ValueError, match="reaches past this base's 8 layers"):
        build_heads(head_config("eagle3", aux_layers=[2, 8]), base_shape(model.config),
                    model.lm_head.weight)  # fmt: skip


def test_training_time_test_is_drafting_along_the_data(tiny_base):
    """Step j of the unrolled training pass at t is what drafting computes at depth j along
    the data (calibration's unroll, checked against the drafting steps in test_eagle.py), for
    every position whose tokens are in the data; the one lm head is one tensor and every
    trainable weight gets a gradient."""
    heads = random_one_layer_heads(tiny_base, "eagle3", num_heads=3)
    assert len({id(lm) for lm in heads.lm_heads}) == 1 and len(heads.lm_heads) == 3
    assert [n for n in heads.unique_state() if n.startswith("lm_heads")] == ["lm_heads.0.weight"]
    embed = tiny_base.embed_tokens
    T = 12
    torch.manual_seed(1)
    ids = torch.randint(0, tiny_base.vocab_size, (T,))
    feats = torch.randn(T, heads.fc.in_features)
    with torch.no_grad():
        chain = unroll(heads, feats, ids, embed, 3)
    heads.train()
    states = heads(feats[None], embed(ids)[None].detach())
    for j in range(3):
        valid = T - 1 - j  # x_{t+j+1} inside the data
        assert torch.allclose(states[j][0, :valid], heads.norm(chain[j][0, :valid]), atol=1e-5)
    loss = sum(heads.logits(0, s).logsumexp(-1).sum() for s in states)  # logits: norm inside
    loss = loss + sum(heads.lm_heads[0](s).sum() for s in states)
    loss.backward()
    trainable = [n for n, p in heads.named_parameters() if p.requires_grad]
    assert "lm_heads.0.weight" in trainable and "fc.weight" in trainable
    for n, p in heads.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


# -- stand-ins of the engines' EAGLE-3 model ------------------------------------------------------
class EngineLayer(nn.Module):
    """The decoder layer SGLang's / vLLM's LlamaForCausalLMEagle3 build (names as theirs)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        H = c.hidden_size
        self.heads, self.kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        attn = nn.Module()
        attn.q_proj = nn.Linear(2 * H, self.heads * self.hd, bias=False)
        attn.k_proj = nn.Linear(2 * H, self.kv * self.hd, bias=False)
        attn.v_proj = nn.Linear(2 * H, self.kv * self.hd, bias=False)
        attn.o_proj = nn.Linear(self.heads * self.hd, H, bias=False)
        self.self_attn = attn
        self.mlp = LlamaMLP(c)
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self, n, LlamaRMSNorm(H, eps=c.rms_norm_eps))

    def forward(self, emb, hidden, cos_sin, past, mask):
        residual = hidden  # norm_before_residual = false: EAGLE-3's
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        B, T, _ = x.shape
        a = self.self_attn
        q = a.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = a.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = a.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        if past:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        past[:] = [k, v]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = residual + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class EngineEagle3(nn.Module):
    """fc, the layer (`midlayer` or `layers.0`), norm, lm_head, d2t, t2d, from the exported
    config.json alone; logits scattered to the target vocab at i + d2t[i] (vLLM's
    compute_logits), the pre-norm output fed back (both engines)."""

    def __init__(self, cfg: dict, layout: str):
        super().__init__()
        llama = cfg["transformer_layer_config"] if layout == "speculators" else cfg
        keys = set(LlamaConfig().to_dict()) - {"architectures"}
        c = LlamaConfig(**{k: v for k, v in llama.items() if k in keys})
        H, D = c.hidden_size, cfg["draft_vocab_size"]
        self.fc = nn.Linear(3 * cfg.get("target_hidden_size", H), H, bias=False)
        if layout == "speculators":
            assert cfg["norm_before_residual"] is False
            self.layers = nn.ModuleList([EngineLayer(c)])
        else:
            assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
            self.midlayer = EngineLayer(c)
        self.norm = LlamaRMSNorm(H, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(H, D, bias=False)
        self.register_buffer("d2t", torch.zeros(D, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.rope = LlamaRotaryEmbedding(c)
        self.vocab = c.vocab_size

    def layer(self):
        return self.layers[0] if hasattr(self, "layers") else self.midlayer

    def full_logits(self, h):
        logits = self.lm_head(self.norm(h))
        out = logits.new_full((*logits.shape[:-1], self.vocab), float("-inf"))
        out[..., torch.arange(logits.shape[-1]) + self.d2t] = logits
        return out

    def prefill_and_chain(self, aux, ids, drafts, embed):
        """Logits over the prompt (T, V) and along a chain of drafted tokens (len, V)."""
        T = ids.numel()
        past: list = []
        nxt = torch.cat([ids[1:], torch.tensor(drafts[:1])])
        pos = torch.arange(T)[None]
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
        h = self.layer()(embed(nxt)[None], self.fc(aux)[None], self.rope(aux, pos), past, causal)
        prompt = self.full_logits(h[0])
        state, chain = h[:, -1:], [prompt[-1]]
        for d, tok in enumerate(drafts[1:], start=1):
            p = torch.tensor([[T - 1 + d]])
            state = self.layer()(embed(torch.tensor([[tok]])), state, self.rope(state, p), past,
                                 None)  # fmt: skip
            chain.append(self.full_logits(state[0, 0]))
        return prompt, torch.stack(chain)


def _ours_full(heads, logits):
    out = logits.new_full((*logits.shape[:-1], heads.vocab_size), float("-inf"))
    idx = heads.draft.to_full if heads.draft is not None else torch.arange(heads.vocab_size)
    out[..., idx] = logits
    return out


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_exports_load_into_the_engines_layouts_with_the_same_logits(tmp_path, tiny_base, layout):
    """format=eagle3 / speculators: the engine stand-in built from the exported config.json
    loads model.safetensors strictly (no embedding: the engines share the base's) and gives
    ours logits bit for bit over the prompt, and along a drafted chain; imported back, the
    same weights, tensor for tensor."""
    from train.export import export_heads, import_heads
    from train.heads import heads_meta, load_heads, save_heads

    torch.manual_seed(0)
    draft = torch.randperm(tiny_base.vocab_size)[:150].sort().values
    heads = build_heads(
        head_config("eagle3", num_heads=2, draft_vocab_size=150, init="official"),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
        draft,
    )
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    heads.eval()
    tiny = base_config("tiny_random", name="tiny_random")
    hdir = save_heads(
        tmp_path / "h", heads, heads_meta(heads, tiny_base.fingerprint(), tiny.to_dict())
    )
    res = export_heads(hdir, layout, tmp_path / "x")
    assert res["files"] == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 150 and cfg["target_hidden_size"] == 64
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert state["d2t"].dtype == torch.long and state["t2d"].dtype == torch.bool
    assert int(state["t2d"].sum()) == 150
    engine = EngineEagle3(cfg, layout)
    engine.load_state_dict(state, strict=True)
    engine.eval()
    embed = tiny_base.embed_tokens
    torch.manual_seed(2)
    ids = torch.randint(0, tiny_base.vocab_size, (9,))
    aux = torch.randn(9, 3 * 64)
    drafts = [int(x) for x in torch.randint(0, tiny_base.vocab_size, (4,))]
    with torch.no_grad():
        prompt, chain = engine.prefill_and_chain(aux, ids, drafts, embed)
        nxt = torch.cat([ids[1:], torch.tensor(drafts[:1])])
        ours = heads.context(aux[None], next_emb=embed(nxt)[None])
        assert torch.equal(_ours_full(heads, heads.logits(0, ours[0])), prompt)
        path = torch.cat([ids, torch.tensor(drafts)])
        steps = unroll(heads, torch.cat([aux, torch.zeros(4, 3 * 64)]), path, embed, 4)
        got = torch.stack([_ours_full(heads, heads.logits(0, steps[d][0, 8])) for d in range(4)])
    fin = torch.isfinite(chain)
    assert torch.equal(fin, torch.isfinite(got)) and int(fin.sum()) == 4 * 150
    assert torch.allclose(got[fin], chain[fin], atol=1e-5)
    import_heads(tmp_path / "x", layout, tiny, tmp_path / "back")
    back, meta = load_heads(tmp_path / "back", tiny_base.fingerprint())
    assert back.arch == "eagle3" and meta["imported"]["format"] == layout
    _assert_same_heads(back, heads)
    # a damaged d2t (a draft token past the vocab) is refused naming the file, not an IndexError
    from safetensors.torch import save_file

    from train.export import FormatError

    state["d2t"][-1] = tiny_base.vocab_size
    save_file(state, str(tmp_path / "x" / "model.safetensors"))
    with pytest.raises(FormatError, match=f"{tmp_path / 'x'}: the draft vocab maps to 1 token id"):
        import_heads(tmp_path / "x", layout, tiny, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def _assert_same_heads(back, want) -> None:
    """`back` (loaded from a round trip) holds `want`'s tensors, name for name, bit for bit."""
    mine, theirs = want.unique_state(), back.unique_state()  # (the steps are training's)
    assert set(mine) == set(theirs)
    for n, t in theirs.items():
        assert torch.equal(t, mine[n]), n


def test_only_eagle3_heads_export_as_eagle3_and_a_normed_residual_is_refused(tmp_path, tiny_base):
    """Other heads are refused by format=eagle3, eagle3 by format=hydra (each naming what to
    export instead); eagle3 goes to hf and back; a speculators draft whose residual is
    normalised (or says nothing, which vLLM reads as normalised) is refused on import."""
    from train.export import FormatError, export_heads, import_heads
    from train.heads import heads_meta, load_heads, save_heads

    def assert_same(hdir, want):
        back, _ = load_heads(hdir, tiny_base.fingerprint())
        assert back.arch == "eagle3"
        _assert_same_heads(back, want)

    tiny = base_config("tiny_random", name="tiny_random")
    heads = random_one_layer_heads(tiny_base, "hydra_eagle")
    hdir = save_heads(
        tmp_path / "h", heads, heads_meta(heads, tiny_base.fingerprint(), tiny.to_dict())
    )
    with pytest.raises(FormatError, match="only head=eagle3"):
        export_heads(hdir, "eagle3", tmp_path / "x")
    e3 = random_one_layer_heads(tiny_base, "eagle3", num_heads=1)
    e3dir = save_heads(tmp_path / "e", e3, heads_meta(e3, tiny_base.fingerprint(), tiny.to_dict()))
    with pytest.raises(FormatError, match="zankner/Hydra has no eagle3 module"):
        export_heads(e3dir, "hydra", tmp_path / "y")
    export_heads(e3dir, "hf", tmp_path / "hf")  # ours, with a model card: back as they were
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Heads"]
    assert "the inputs of layers 1, 1, 0" in (tmp_path / "hf" / "README.md").read_text()
    import_heads(tmp_path / "hf", "hf", tiny, tmp_path / "hf_back")
    assert_same(tmp_path / "hf_back", e3)
    export_heads(e3dir, "speculators", tmp_path / "s")
    cfg_path = tmp_path / "s" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["norm_before_residual"]  # vLLM reads a missing key as true
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="norm_before_residual"):
        import_heads(tmp_path / "s", "speculators", tiny, tmp_path / "back")
    cfg.update(norm_before_residual=False, norm_output=True)  # feeds the normed state back
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="norm_output is true"):
        import_heads(tmp_path / "s", "speculators", tiny, tmp_path / "back")
    # SafeAILab's trainer saves pytorch_model.bin: read when model.safetensors is absent
    export_heads(e3dir, "eagle3", tmp_path / "o")
    from safetensors.torch import load_file

    weights = tmp_path / "o" / "model.safetensors"
    torch.save(load_file(str(weights)), tmp_path / "o" / "pytorch_model.bin")
    weights.unlink()
    import_heads(tmp_path / "o", "eagle3", tiny, tmp_path / "o_back")
    assert_same(tmp_path / "o_back", e3)
    two = random_one_layer_heads(tiny_base, "eagle3", num_heads=1, aux_layers=[0, 1])
    two_dir = save_heads(
        tmp_path / "two", two, heads_meta(two, tiny_base.fingerprint(), tiny.to_dict())
    )
    with pytest.raises(FormatError, match="the engines fuse exactly three"):
        export_heads(two_dir, "eagle3", tmp_path / "t")
