"""Head architectures: registry-wide shape, causality and training-vs-proposal consistency."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    arch_shape,
    feature_width,
    full_vocab_logits,
    head_config,
    head_step,
    propose_chain,
)
from train.decoding.cache import KVCache
from train.heads import HEADS, base_shape, build_heads
from train.heads.blocks import ResBlock

# head sets of K heads with residual blocks (not the one recurrent layer of eagle-attn)
PER_DEPTH = sorted(n for n in HEADS if not HEADS[n].recurrent)


def make(tiny_base, name, draft=None, **kw):
    torch.manual_seed(0)
    heads = build_heads(
        head_config(name, **{**arch_shape(name, 3, 2), **kw}),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
        draft,
    )
    with torch.no_grad():  # random weights: a zero-initialised head would hide wiring bugs
        for p in heads.parameters():
            p.normal_(0, 0.2)
    return heads.eval()


@pytest.mark.parametrize(
    "name", [n for n in sorted(HEADS) if n not in ("hydra_cross_attn", "eagle3")]
)
def test_fresh_heads_start_as_the_base_lm_head(tiny_base, name):
    """init=ours: every head reads h_t unchanged (Hydra++: its extra layer's final RMSNorm of
    h_t, h_t / rms(h_t), so the same top-1 token as the base) through the base's lm_head.
    (cross-attn's residual stream is the next token's embedding: the test below; EAGLE-3's
    reads its fused layers: test_eagle3.py.)"""
    heads = build_heads(
        head_config(name, **arch_shape(name, 3, 2), init="ours"),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
    )
    h = torch.randn(2, 7, 64)
    states = heads(h, torch.randn(2, 7, 64))
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) if name == "hydra_pp" else h
    assert len(states) == heads.num_heads
    for k, s in enumerate(states):
        assert torch.allclose(s, want, atol=1e-5)
        assert torch.equal(heads.lm_heads[k].weight, tiny_base.lm_head.weight)
        assert torch.equal(heads.logits(k, s).argmax(-1), tiny_base.lm_head(h).argmax(-1))


def test_a_fresh_cross_attn_head_is_the_next_token_s_embedding(tiny_base):
    """init=ours for cross-attn: attention and MLP outputs start at zero, so its state at t is
    e(x_{t+1}), its residual stream, scored by the base's lm_head."""
    heads = build_heads(
        head_config("hydra_cross_attn", init="ours"),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
    )
    h, emb = torch.randn(2, 7, 64), torch.randn(2, 7, 64)
    (state,) = heads(h, emb)
    want = torch.cat([emb[:, 1:], torch.zeros(2, 1, 64)], 1)  # nothing after the last token
    assert torch.allclose(state, want, atol=1e-6)
    assert torch.equal(heads.lm_heads[0].weight, tiny_base.lm_head.weight)


@pytest.mark.parametrize("name", PER_DEPTH)
def test_untied_layers_are_distinct_modules(tiny_base, name):
    """head.tie_blocks=false (an extra: the official heads tie them) gives every block its own."""
    heads = build_heads(
        head_config(name, num_heads=2, num_layers=3, tie_blocks=False),
        base_shape(tiny_base.config),
        tiny_base.lm_head.weight,
    )
    blocks = [m for m in heads.modules() if isinstance(m, ResBlock)]
    assert len(blocks) == 6 and len({id(b.linear.weight) for b in blocks}) == 6


@pytest.mark.parametrize("name", sorted(HEADS))
def test_causality(tiny_base, name):
    """Head k at position t never depends on tokens after x_{t+k} or hidden states after t."""
    heads = make(tiny_base, name)
    T = 12
    torch.manual_seed(1)
    ids = torch.randint(0, 250, (1, T))
    hidden = torch.randn(1, T, feature_width(heads))
    base = heads(hidden, tiny_base.embed_tokens(ids))
    for k in range(1, heads.num_heads + 1):
        for t in range(0, T - k - 1):
            ids2, hid2 = ids.clone(), hidden.clone()
            ids2[0, t + k + 1 :] = (ids2[0, t + k + 1 :] + 7) % 250
            hid2[0, t + 1 :] = torch.randn_like(hid2[0, t + 1 :])
            out = heads(hid2, tiny_base.embed_tokens(ids2))[k - 1]
            assert torch.allclose(out[0, t], base[k - 1][0, t], atol=1e-5), (k, t)
            # ...and Hydra heads do read the last token of their path, x_{t+k}.
            ids3 = ids.clone()
            ids3[0, t + k] = (ids3[0, t + k] + 1) % 250
            out3 = heads(hidden, tiny_base.embed_tokens(ids3))[k - 1]
            assert heads.uses_path == (not torch.allclose(out3[0, t], base[k - 1][0, t])), (k, t)


@pytest.mark.parametrize("name", PER_DEPTH)
def test_proposal_step_equals_teacher_forcing(tiny_base, name):
    """step() on the true path reproduces the teacher-forced logits at every position."""
    heads = make(tiny_base, name)
    T = 10
    ids = torch.randint(0, 250, (2, T))
    hidden = torch.randn(2, T, 64)
    states = heads(hidden, tiny_base.embed_tokens(ids))
    ctx = heads.context(hidden)
    for k in range(3):
        for t in range(T - k - 1):  # every position whose path lies inside the sequence
            path = ids[:, t + 1 : t + k + 2]
            got = head_step(heads, k, ctx[:, t], path, tiny_base.embed_tokens)
            want = full_vocab_logits(heads, heads.logits(k, states[k][:, t]))
            assert torch.allclose(got, want, atol=1e-5), (k, t)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_selected_positions_equal_the_full_forward(tiny_base, name):
    """forward(select=...) runs head k only at the given (b, t): the same states as the full
    forward at those positions, last positions (zero path past the end) and empty sets too."""
    heads = make(tiny_base, name)
    B, T = 2, 9
    ids = torch.randint(0, 250, (B, T))
    hidden, emb = torch.randn(B, T, feature_width(heads)), tiny_base.embed_tokens(ids)
    full = heads(hidden, emb)
    torch.manual_seed(3)
    select = []
    for k in range(heads.num_heads):
        mask = torch.rand(B, T) < 0.5
        mask[1, T - 1] = k != 1  # the last position of a row; head 2 gets no position at all
        if k == 1:
            mask[:] = False
        select.append(mask.nonzero(as_tuple=True))
    part = heads(hidden, emb, None, select)
    for k, (b, t) in enumerate(select):
        assert part[k].shape == (b.numel(), 64)
        assert torch.allclose(part[k], full[k][b, t], atol=1e-6), k


def test_hydra_pp_kv_cache_matches_full_context(tiny_base):
    heads = make(tiny_base, "hydra_pp")
    hidden = torch.randn(1, 9, 64)
    full = heads.context(hidden)
    cache = KVCache(1, 16)
    parts = [heads.context(hidden[:, :5], cache=cache), heads.context(hidden[:, 5:7], cache=cache)]
    cache.crop(-1)  # drop a rejected position, then feed the accepted one again
    parts = [parts[0], parts[1][:, :1], heads.context(hidden[:, 6:9], cache=cache)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)


@pytest.mark.parametrize("name", PER_DEPTH)
def test_draft_vocab_maps_back_to_full_ids(tiny_base, name):
    draft = torch.tensor([0, 5, 17, 42, 99, 100, 200, 250] + list(range(10, 18)))
    draft = torch.sort(torch.unique(draft)).values
    heads = make(tiny_base, name, draft=draft)
    assert heads.out_vocab_size == len(draft)
    logits = head_step(
        heads, 0, torch.randn(3, 64), torch.randint(0, 250, (3, 1)), tiny_base.embed_tokens
    )
    assert logits.shape == (3, 259)
    top = logits.argmax(-1)
    assert all(int(x) in set(draft.tolist()) for x in top)
    outside = torch.ones(259, dtype=torch.bool)
    outside[draft] = False
    assert torch.isinf(logits[:, outside]).all()
    chain = propose_chain(heads, torch.randn(2, 64), torch.tensor([1, 2]), tiny_base.embed_tokens)
    assert chain.shape == (2, 3) and all(int(x) in set(draft.tolist()) for x in chain.flatten())


def test_config_validation_names_keys():
    from train.core.errors import ConfigError

    with pytest.raises(ConfigError, match="'num_heads'"):
        head_config("hydra", num_heads=0)
    with pytest.raises(ConfigError, match="'draft_vocab_size'"):
        head_config("hydra", draft_vocab_size=3)


def test_a_hidden_state_offset_past_the_base_is_a_config_error(tiny_base):
    from train.core.errors import ConfigError

    shape, w = base_shape(tiny_base.config), tiny_base.lm_head.weight
    n = tiny_base.config.num_hidden_layers
    build_heads(head_config("hydra", hidden_state_offset=n - 1), shape, w)  # the first layer's
    with pytest.raises(ConfigError, match=f"hidden_state_offset={n} reaches past this base's {n}"):
        build_heads(head_config("hydra", hidden_state_offset=n), shape, w)


@pytest.mark.parametrize(("name", "first"), [("hydra", 1), ("hydra_pp", 1), ("medusa", 0)])
def test_tied_blocks_are_one_module_and_save_once(tmp_path, tiny_base, name, first):
    """head.tie_blocks: the H -> H blocks of a head are one module (zankner/Hydra's
    `[ResBlock] * n`), trained as one, saved once and loaded back into every place."""
    from train.heads import heads_meta, load_heads, save_heads

    heads = make(tiny_base, name, tie_blocks=True, num_layers=4)
    for mlp in heads.mlps:
        assert all(block is mlp[first] for block in list(mlp)[first:])
        assert first == 0 or mlp[0] is not mlp[1]
    n_params = sum(p.numel() for p in heads.parameters())
    untied = make(tiny_base, name, tie_blocks=False, num_layers=4)
    assert n_params < sum(p.numel() for p in untied.parameters())
    saved = save_heads(tmp_path / "h", heads, heads_meta(heads, tiny_base.fingerprint(), {}))
    from safetensors import safe_open

    with safe_open(str(saved / "heads.safetensors"), "pt") as f:
        names = set(f.keys())
    assert f"mlps.0.{first}.linear.weight" in names and "mlps.0.3.linear.weight" not in names
    back, _ = load_heads(saved, tiny_base.fingerprint())
    assert back.mlps[0][3] is back.mlps[0][first]
    h, e = torch.randn(1, 6, 64), torch.randn(1, 6, 64)
    for a, b in zip(heads(h, e), back(h, e), strict=True):
        assert torch.equal(a, b)


def test_hydra_pp_checkpoints_from_before_the_official_layer_are_refused(tmp_path, tiny_base):
    """A Hydra++ checkpoint whose extra layer had no final norm must not load into today's."""
    from safetensors.torch import load_file, save_file

    from train.core.checkpoint import HeadsMismatchError
    from train.heads import heads_meta, load_heads, save_heads

    heads = make(tiny_base, "hydra_pp")
    saved = save_heads(tmp_path / "h", heads, heads_meta(heads, tiny_base.fingerprint(), {}))
    state = {k: v for k, v in load_file(str(saved / "heads.safetensors")).items()}
    old = {k: v for k, v in state.items() if not k.startswith("prefix.")}
    old |= {f"prefix.{n}.weight": torch.zeros(1) for n in ("attn_norm", "q_proj", "mlp_norm")}
    save_file(old, str(saved / "heads.safetensors"))
    with pytest.raises(HeadsMismatchError, match="no final RMSNorm.*Retrain them"):
        load_heads(saved, tiny_base.fingerprint())
