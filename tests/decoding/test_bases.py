"""Bases beyond Llama in the decoder: sliding-window layers (Mistral, Mixtral, Qwen2, Phi-3,
Gemma-2's alternating ones), Gemma-2's soft-capping, Qwen3's q/k norms, Phi-3's fused
projections and partial rotary, MoE routing (Mixtral, Qwen3-MoE). Tiny random models built from
transformers' own classes, decoded past their window: plain decoding equals transformers'
`generate` (its own caches and masks), and greedy speculative decoding, at batch 1 and batch
B, equals plain. docs/architecture.md: "Bases"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from tests.families import FAMILIES, SHAPE, WINDOW, tiny
from tests.helpers import make_heads
from train.decoding.backend import use_gqa_attention
from train.decoding.decoder import Decoder
from train.decoding.dynamic import DynamicTree
from train.decoding.masks import AttentionLayout, AttentionLayoutError
from train.decoding.tree import PRESETS, Tree


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (12 + 5 * (i % 2),), generator=g).tolist() for i in range(n)]


def reference(model, ids: list[int], new: int) -> list[int]:
    """transformers' own greedy decode: its caches (sliding layers drop old entries) and masks."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plain_and_speculative_greedy_equal_transformers_generate(family):
    model = tiny(family)
    ps = prompts(3)
    want = [reference(model, ids, 24) for ids in ps]
    assert any(len(set(w)) > 4 for w in want), "the reference replies are too repetitive"
    use_gqa_attention(model)
    heads = make_heads(model, "hydra_pp", seed=2, scale=0.1)
    dec = Decoder(model, set(), heads)
    assert [dec.plain([ids], 24)[0].tokens for ids in ps] == want
    assert [g.tokens for g in dec.plain(ps, 24)] == want  # batch B: holes in the mask
    trees = [Tree.from_paths(PRESETS[n]) for n in ("chain_4", "sparse_15", "mc_sim_7b_63")]
    for tree in (*trees, DynamicTree(budget=12, expand=3, width=3)):
        dec.set_tree(tree)
        spec = [dec.speculative([ids], 24)[0] for ids in ps]
        assert [g.tokens for g in spec] == want, type(tree).__name__
        assert sum(sum(g.accepted) for g in spec) > 0  # the trees were verified, not skipped
        assert [g.tokens for g in dec.speculative(ps, 24)] == want


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_ignoring_the_window_breaks_speculation(family):
    """The check above can fail: with the window left out of the decoder's masks, the tree
    verify attends past it and speculative greedy leaves transformers' greedy decode."""
    model = tiny(family)
    ps = prompts(3)
    want = [reference(model, ids, 24) for ids in ps]
    use_gqa_attention(model)
    dec = Decoder(model, set(), make_heads(model, "hydra_pp", seed=2, scale=0.3))
    dec.set_tree(Tree.from_paths(PRESETS["sparse_15"]))
    assert dec.layout.sliding and dec.layout.window == WINDOW
    dec.layout.sliding = False
    assert [dec.speculative([ids], 24)[0].tokens for ids in ps] != want


def test_layouts_read_from_configs():
    mistral = AttentionLayout(transformers.MistralConfig(**SHAPE, sliding_window=WINDOW))
    assert (mistral.sliding, mistral.per_kind, mistral.window) == (True, False, WINDOW)
    full = AttentionLayout(transformers.MistralConfig(**SHAPE, sliding_window=None))
    assert not full.sliding
    qwen = AttentionLayout(transformers.Qwen2Config(**SHAPE))  # use_sliding_window=false
    assert qwen.per_kind and not qwen.sliding
    mask = torch.zeros(1, 1, 2, 12)
    assert AttentionLayout(transformers.LlamaConfig(**SHAPE)).apply(mask, None, 10) is mask
    got = mistral.apply(mask, torch.tensor([[10, 11]]), 10)  # queries at 10, 11; keys 0..11
    seen = (got[0, 0] == 0).nonzero().tolist()
    assert {k for q, k in seen if q == 0} == set(range(3, 12))  # 10 - 8 < k (11: its mask's)
    assert {k for q, k in seen if q == 1} == set(range(4, 12))


def test_unsupported_layer_kinds_are_refused_by_name():
    config = transformers.Qwen2Config(**SHAPE)
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(AttentionLayoutError, match="chunked_attention"):
        AttentionLayout(config)


def test_compiled_decoding_refuses_a_sliding_window():
    model = tiny("mistral")
    with pytest.raises(AttentionLayoutError, match="eval.compile=false"):
        Decoder(model, set(), compile=True)


def test_soft_capped_attention_keeps_its_own_attention_function():
    """Gemma-2 caps its attention scores, which SDPA cannot: use_gqa_attention leaves it on
    its own function. Switched anyway, its decode leaves transformers' (the control)."""
    from train.decoding import backend

    model = tiny("gemma2")
    ps = prompts(3)
    want = [reference(model, ids, 24) for ids in ps]
    use_gqa_attention(model)
    assert model.config._attn_implementation == "eager"
    forced = tiny("gemma2")
    backend.use_gqa_attention(forced)
    forced.config._attn_implementation = backend.ATTENTION
    assert [Decoder(forced, set()).plain([ids], 24)[0].tokens for ids in ps] != want


def test_decoder_logits_are_the_models_own_soft_capped_ones():
    """Gemma-2's final_logit_softcapping keeps the argmax but not the distribution sampled."""
    model = tiny("gemma2")
    ids = torch.tensor(prompts(1))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        got = Decoder(model, set()).lm_head(out.hidden_states[-1])
    torch.testing.assert_close(got, out.logits)
    assert not torch.allclose(model.lm_head(out.hidden_states[-1]), out.logits)


def test_decoder_reads_the_lm_head_the_model_has_now(tiny_base):
    """use_weight_layout swaps the base's lm_head for a packed one after the decoder is built
    (evaluate.py); the decoder's logits come from whatever lm_head the model holds."""
    model = tiny_base.model
    dec = Decoder(model, set())
    original, calls = model.lm_head, []

    class Counting(torch.nn.Module):
        def forward(self, x):
            calls.append(x.shape)
            return original(x)

    model.lm_head = Counting()
    try:
        dec.plain([[5, 6, 7]], 4)
    finally:
        model.lm_head = original
    assert len(calls) == 4  # the prefill's root and three one-token steps


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "phi3"])
def test_regeneration_slab_equals_transformers_generate(family):
    """Self-distillation's left-padded strategy on windowed bases: transformers builds each
    layer kind's mask from the slab's 2-D mask, so replies equal `generate`'s, with rows of
    different prompt lengths and rows leaving the batch at their EOS. The control: the same
    model with its window switched off replies otherwise."""
    from train.decoding.slab import generate_left_padded

    model = tiny(family)
    ps = [*prompts(12), [5, 6, 7]]
    want = [reference(model, ids, 30) for ids in ps]
    counts = torch.bincount(torch.tensor([t for w in want for t in w]), minlength=96)
    eos = int(counts.argsort(descending=True)[2])  # a frequent token: rows end at it
    want = [w[: w.index(eos) + 1] if eos in w else w for w in want]
    assert 0 < sum(eos in w for w in want) < len(want)
    use_gqa_attention(model)
    assert generate_left_padded(model, ps, 30, {eos}, 0, 0.0, 1.0) == want
    if family == "mistral":
        model.config.sliding_window = None
        assert generate_left_padded(model, ps, 30, {eos}, 0, 0.0, 1.0) != want


def test_regeneration_refuses_unsupported_layer_kinds_by_name():
    from data_prep.config import RegenError
    from data_prep.regenerate import generate_replies

    model = tiny("qwen2")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(RegenError, match="chunked_attention.*regenerate=false"):
        generate_replies(SimpleNamespace(model=model), [[5, 6, 7]], None)  # checked first
