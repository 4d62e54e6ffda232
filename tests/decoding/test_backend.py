"""The decode backend: the grouped-KV attention kernel, quantized bases, and compiled decoding,
each against the plain path."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import make_heads
from train.decoding import backend
from train.decoding.backend import (
    BackendError,
    PackedLinear,
    forward,
    quantize_base,
    use_gqa_attention,
    use_weight_layout,
)
from train.decoding.cache import new_cache
from train.decoding.decoder import Decoder
from train.decoding.tree import PRESETS, Tree, tree_bias

PROMPT = [5, 17, 3, 99, 42, 7, 61, 8, 23, 11]


def test_gqa_attention_equals_transformers_sdpa(tiny_base):
    """The grouped-KV kernel against transformers' own sdpa (which repeats the KV heads), with a
    tree mask over a cached prefix and without a mask."""
    assert tiny_base.model.config.num_key_value_heads < tiny_base.model.config.num_attention_heads
    ours = copy.deepcopy(tiny_base.model)
    use_gqa_attention(ours)
    assert ours.config._attn_implementation != tiny_base.model.config._attn_implementation
    tree = Tree.from_paths(PRESETS["sparse_7"])
    mask = torch.zeros(1, 1, tree.num_nodes, 10 + tree.num_nodes)
    mask[0, 0, :, 10:] = tree_bias(tree, torch.float32)
    tokens = torch.randint(0, 200, (1, tree.num_nodes))
    outs = []
    for model in (tiny_base.model, ours):
        cache = new_cache(model, 32)
        a, _ = forward(model, torch.tensor([PROMPT]), torch.arange(10)[None], cache)
        b, _ = forward(model, tokens, (10 + tree.depth)[None], cache, mask)
        outs.append(torch.cat([a[0], b[0]]))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("quant", ["bf16", "int8"])
def test_quantized_base_decodes_its_own_greedy_tokens_with_heads_in_its_dtype(tiny_base, quant):
    """Plain decoding through our loop equals transformers' generate on the same quantized
    model; speculative decoding runs the heads in the base's compute dtype (a copy: the heads
    given stay float32) and emits valid tokens."""
    model = quantize_base(copy.deepcopy(tiny_base.model), quant)
    linear = type(model.model.layers[0].mlp.down_proj).__module__
    assert ("quantized" in linear) == (quant == "int8")
    assert (next(model.parameters()).dtype == torch.bfloat16) == (quant == "bf16")
    heads = make_heads(tiny_base.model, "hydra", 2, 0.05)
    dec = Decoder(model, set(), heads, Tree.from_paths(PRESETS["sparse_15"]))
    want = torch.bfloat16 if quant == "bf16" else torch.float32
    assert dec.embed.weight.dtype == want and next(dec.heads.parameters()).dtype == want
    assert next(heads.parameters()).dtype == torch.float32
    ref = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()  # fmt: skip
    assert dec.plain([PROMPT], 20)[0].tokens == ref
    spec = dec.speculative([PROMPT], 20)[0]
    assert len(spec.tokens) == 20 and spec.tau >= 1.0
    assert all(0 <= t < model.config.vocab_size for t in spec.tokens)


def test_packed_linear_computes_the_same_product_with_either_weight():
    lin = torch.nn.Linear(48, 80)
    take = (False,) + (False,) * 3 + (True,) * 9 + (False,) * 3 + (True,)  # 4-12, 16+
    packed = PackedLinear(lin, take)
    assert packed.weight is lin.weight and packed.bias is lin.bias  # shared: ties stay tied
    calls = []
    real = backend.packed_linear
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "packed_linear", lambda *a: calls.append(1) or real(*a))
        for rows, used in [(1, False), (4, True), (12, True), (14, False), (16, True), (40, True)]:
            x = torch.randn(rows, 48)
            n = len(calls)
            assert torch.allclose(packed(x), lin(x), atol=1e-5)
            assert (len(calls) > n) is used, rows
    x = torch.randn(2, 3, 48)  # (B, n, H): the rows are B * n = 6
    assert torch.allclose(packed(x), lin(x), atol=1e-5)
    twin = copy.deepcopy(packed)  # packs its own copy of the weight
    assert twin.weight is not lin.weight and torch.equal(twin.weight, lin.weight)
    assert torch.allclose(twin(x), lin(x), atol=1e-5)
    cast = copy.deepcopy(packed).to(torch.bfloat16)  # the packed copy is stale: not used
    assert torch.allclose(cast(x.bfloat16()).float(), lin(x), atol=0.1)


def test_packed_layout_decodes_the_same_tokens_and_skips_what_it_cannot_help(tiny_base):
    """With the packed copies taken at every row count, in the base and in the heads, greedy
    speculative decoding still equals plain decoding, and both equal the standard layout's;
    int8 weights are left alone."""
    heads = make_heads(tiny_base.model, "hydra_pp", 4, 0.05)
    tree = Tree.from_paths(PRESETS["sparse_15"])
    ref = Decoder(tiny_base.model, set(), heads, tree)
    want = ref.plain([PROMPT], 24)[0].tokens
    model, packed_heads = copy.deepcopy(tiny_base.model), copy.deepcopy(heads)
    chosen = use_weight_layout(model, packed_heads, None, layout="packed")
    assert chosen and all(v == "1+" for v in chosen.values())
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)
    assert any(isinstance(m, PackedLinear) for m in packed_heads.modules())
    dec = Decoder(model, set(), packed_heads, tree)
    assert dec.plain([PROMPT], 24)[0].tokens == want
    assert dec.speculative([PROMPT], 24)[0].tokens == want
    assert use_weight_layout(copy.deepcopy(tiny_base.model), layout="standard") == {}
    assert use_weight_layout(quantize_base(copy.deepcopy(tiny_base.model), "int8")) == {}
    with pytest.raises(BackendError, match="eval.weight_layout='nn' is invalid"):
        use_weight_layout(model, layout="nn")


def _onednn_packs_bf16() -> bool:
    try:
        backend.pack(torch.zeros(8, 8, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(
    not _onednn_packs_bf16(),
    reason="this CPU's oneDNN cannot reorder bf16 weights (it needs AVX512-BW/VL/DQ or "
    "AVX-NE-CONVERT); test_a_dtype_that_cannot_be_packed_keeps_torch_s_matmul covers it",
)
def test_bf16_weights_are_packed_too_and_decode_as_the_standard_layout(tiny_base):
    """A bf16 base's linears get bf16 packed copies (oneDNN reorders a bf16 weight at every
    call otherwise: on a 2-core Sapphire Rapids SmolLM2's linears took 35 ms a step against 25
    packed); the product is the standard one's to bf16 rounding, and the decode the same."""
    bf16 = copy.deepcopy(tiny_base.model).to(torch.bfloat16)
    want = Decoder(bf16, set()).plain([PROMPT], 24)[0].tokens
    chosen = use_weight_layout(bf16, layout="packed")
    assert chosen and all(k.endswith(" bfloat16") and v == "1+" for k, v in chosen.items())
    down = bf16.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.weight.dtype == torch.bfloat16
    x = torch.randn(5, down.in_features, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, down.weight, down.bias).float()
    assert torch.allclose(down(x).float(), ref, rtol=2e-2, atol=2e-2)
    assert Decoder(bf16, set()).plain([PROMPT], 24)[0].tokens == want
    back = copy.deepcopy(down).to(torch.float32)  # the bf16 copy is stale: not used
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "packed_linear", lambda *a: calls.append(1))
        assert torch.allclose(back(x.float()), ref, rtol=2e-2, atol=2e-2) and not calls


@pytest.mark.parametrize("units", [True, False])
def test_auto_packs_bf16_untimed_where_the_cpu_has_bf16_units(tiny_base, monkeypatch, units):
    """On a CPU with bf16 units a bf16 weight takes its packed copy at every row count without
    timing (torch's bf16 matmul is the same kernel after a reorder per call); without them,
    and for float32 weights, the timing decides."""
    timed = []

    def fake(weights, packed):
        timed.append(weights[0].dtype)
        return (False,) + (True,) * 3 + (False,) * (backend.PROBE_ROWS[-1] - 3)

    monkeypatch.setattr(backend, "packed_rows", fake)
    monkeypatch.setattr(backend, "cpu_has_bf16", lambda: units)
    # the choice alone, on any CPU: a stand-in copy (real bf16 packing needs AVX-512)
    monkeypatch.setattr(backend, "pack", lambda w: w.detach().clone())
    bf16 = copy.deepcopy(tiny_base.model).to(torch.bfloat16)
    chosen = use_weight_layout(bf16, copy.deepcopy(tiny_base.model))
    assert chosen and all(v == ("1+" if k.endswith("bfloat16") and units else "1-3")
                          for k, v in chosen.items())  # fmt: skip
    assert set(timed) == ({torch.float32} if units else {torch.float32, torch.bfloat16})


def test_a_dtype_that_cannot_be_packed_keeps_torch_s_matmul(tiny_base, monkeypatch):
    """Where oneDNN cannot reorder bf16 weights (an AMD EPYC with AVX2 only), a bf16 base keeps
    torch's bf16 matmul and its float32 heads still get packed copies; layout=packed names the
    weights it cannot pack. Before, one refusal left every weight unpacked."""
    real = backend.pack

    def float32_only(weight):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support")
        return real(weight)

    monkeypatch.setattr(backend, "pack", float32_only)
    monkeypatch.setattr(backend, "cpu_has_bf16", lambda: False)
    # the timing says "packed" at every row count, whatever this machine measures
    monkeypatch.setattr(
        backend, "packed_rows", lambda w, p: (False,) + (True,) * backend.PROBE_ROWS[-1]
    )
    bf16 = copy.deepcopy(tiny_base.model).to(torch.bfloat16)
    heads = copy.deepcopy(tiny_base.model)  # float32 weights beside the bf16 ones
    chosen = use_weight_layout(bf16, heads, layout="auto")
    assert chosen and not any("bfloat16" in k for k in chosen)
    assert not any(isinstance(m, PackedLinear) for m in bf16.modules())
    assert sum(isinstance(m, PackedLinear) for m in heads.modules()) > 0
    with pytest.raises(BackendError, match=r"cannot prepack the \d+x\d+ bfloat16 weights"):
        use_weight_layout(copy.deepcopy(tiny_base.model).to(torch.bfloat16), layout="packed")


def test_a_torch_that_cannot_pack_keeps_the_standard_layout(tiny_base, monkeypatch):
    """auto falls back to torch's own matmul; packed, asked for explicitly, says why not."""

    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: unsupported")

    monkeypatch.setattr(backend, "pack", refuse)
    model = copy.deepcopy(tiny_base.model)
    assert use_weight_layout(model) == {}
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(BackendError, match="cannot prepack.*weight_layout=auto or standard"):
        use_weight_layout(model, layout="packed")
    with pytest.raises(BackendError, match="^regen.weight_layout=packed: .*use regen.weight"):
        use_weight_layout(model, layout="packed", key="regen.weight_layout")


def test_packed_rows_are_row_counts_the_machine_timed():
    weights = [torch.randn(64, 32) for _ in range(3)]
    take = backend.packed_rows(weights, [backend.pack(w) for w in weights])
    assert len(take) == backend.PROBE_ROWS[-1] + 1 and take[0] is False
    # each count takes the choice timed at the next probed count: a span never splits one
    for n in range(1, len(take)):
        probe = next(p for p in backend.PROBE_ROWS if p >= n)
        assert take[n] == take[probe]


def test_auto_layout_packs_each_shape_where_its_timing_says(tiny_base, monkeypatch):
    """layout=auto times each weight shape once, over every distinct weight of that shape
    and packs exactly the layers of the shapes it favours."""
    model = copy.deepcopy(tiny_base.model)
    timed = {}
    favoured = tuple(model.model.layers[0].mlp.down_proj.weight.shape)

    def fake(weights, packed):
        shape = tuple(weights[0].shape)
        timed[shape] = len(weights)
        return (False,) + (shape == favoured,) * backend.PROBE_ROWS[-1]

    monkeypatch.setattr(backend, "packed_rows", fake)
    chosen = use_weight_layout(model)
    n_layers = model.config.num_hidden_layers
    assert timed[favoured] == n_layers
    assert chosen == {"x".join(map(str, favoured)): "1+"}
    assert all(isinstance(layer.mlp.down_proj, PackedLinear) for layer in model.model.layers)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_unknown_quantization_fails_clearly(tiny_base):
    with pytest.raises(BackendError, match="eval.base_quant='fp4' is invalid"):
        quantize_base(tiny_base.model, "fp4")


def test_compiled_decoding_is_lossless_and_reports_its_compile_time(tiny_base):
    """eval.compile: one graph per (tokens per forward, capacity bucket), its compile time
    apart from the decode times, and the same tokens as eager plain greedy decoding."""
    heads = make_heads(tiny_base.model, "hydra_pp", 3, 0.05)
    ref = Decoder(tiny_base.model, set(), heads).plain([PROMPT], 24)[0].tokens
    tree = Tree.from_paths(PRESETS["sparse_7"])
    dec = Decoder(tiny_base.model, set(), heads, tree, compile=True)
    spec = dec.speculative([PROMPT], 24)[0]
    assert spec.tokens == ref
    assert dec.plain([PROMPT], 24)[0].tokens == ref
    assert dec.compiled_shapes == {(1, 256), (tree.num_nodes, 256)}
    assert spec.compile_s > 0 and dec.compile_s >= spec.compile_s
    again = dec.speculative([PROMPT], 24)[0]  # nothing left to compile
    assert again.tokens == ref and again.compile_s == 0
    # another prompt and length: the graphs write into the bucket's one cache, not a stale one
    longer = list(range(5, 35))
    ref = Decoder(tiny_base.model, set(), heads).plain([longer], 150)[0].tokens
    assert dec.speculative([longer], 150)[0].tokens == ref
    with pytest.raises(ValueError, match="one prompt at a time"):
        dec.plain([PROMPT, longer], 8)


class FakeClock:
    """perf_counter for `race`: each timed call advances it by the call's cost times the
    machine's speed factor of the moment, which `slow` gives per call index."""

    def __init__(self, slow=lambda i: 1.0):
        self.now, self.calls, self.slow = 0.0, 0, slow

    def __call__(self) -> float:
        return self.now

    def call(self, cost: float):
        def run():
            self.now += cost * self.slow(self.calls)
            self.calls += 1

        return run


def test_race_times_the_two_alternately_so_a_slow_spell_cannot_pick_the_winner():
    """a and b cost the same; a spell slows the machine 1.5x for the next three calls after
    the warm-ups. Timed one after the other (a, a, a, then b, b, b) a would take all of it and
    b would win by a third; alternated, each keeps a clean best."""
    clock = FakeClock(lambda i: 1.5 if 2 <= i < 5 else 1.0)
    a, b = backend.race(clock.call(1.0), clock.call(1.0), 3, clock)
    assert a == b == 1.0
    assert clock.calls == 2 + 2 * 3  # one warm-up each, then 3 reps each


@pytest.mark.parametrize(("packed_s", "takes"), [(0.99, False), (0.975, False), (0.95, True)])
def test_packed_rows_take_the_copy_only_past_the_margin(monkeypatch, packed_s, takes):
    """Near a tie torch's own matmul stays (the choice must not flip with the noise from run
    to run); a clear win takes the packed copy."""
    monkeypatch.setattr(backend, "race", lambda a, b, reps: (1.0, packed_s))
    weights = [torch.randn(8, 4)]
    take = backend.packed_rows(weights, [backend.pack(w) for w in weights])
    assert take[1:] == (takes,) * backend.PROBE_ROWS[-1]
    assert (1 - backend.PACK_MARGIN) * 1.0 < 0.99  # the margin sits between the cases
