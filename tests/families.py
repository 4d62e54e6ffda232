"""Tiny random bases of the families beyond Llama, built from transformers' own classes (no
download), and saved as a user's model directory (`base.source=pretrained base.path=DIR`) with
a byte-level tokenizer that carries the family's special tokens and chat template.

The templates are the families' published chat formats, cut to what chat data uses (no tools
or images): Qwen2.5's ChatML with its default system prompt, Qwen3's ChatML with the think gate
(an empty `<think>` block on the last reply only, so earlier turns are re-rendered without it),
Mistral's `[INST]`, Gemma's `<start_of_turn>` (no system role, `assistant` named `model`,
contents trimmed) and Phi-3's `<|user|>` / `<|end|>` (an end-of-text token after the last turn
unless a generation prompt is added). Qwen3's and Phi-3's renderings of a conversation are not
prefixes of its continuation, which is what data_prep.template meets in real bases."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

WINDOW = 8  # positions; the decoding tests' prompts are 12-17 tokens and 24 more are decoded
SHAPE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2": (  # layer 0 full, layer 1 sliding
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1),
    ),
    "gemma2": (  # alternating sliding / full, attention and final soft-capping, tied embeddings
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=1.0,  # small: the cap bites on these scores
            final_logit_softcapping=2.0,
            tie_word_embeddings=True,
        ),
    ),
    "phi3": (  # fused qkv and gate_up projections, partial rotary, a sliding window
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(sliding_window=WINDOW, partial_rotary_factor=0.5, pad_token_id=0),
    ),
}

_QWEN25 = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if not ns.found and message.role == 'user' %}{%- set ns.found = true %}"
    "{%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is defined "
    "else '' %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + "
    "message.content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
_ALTERNATE = (
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for message in messages %}" + _ALTERNATE + "{% if message['role'] == "
    "'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
_GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}" + _ALTERNATE + "{% if message['role'] == 'assistant' %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
_PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# family: (chat template, special tokens, bos, eos (the end of a reply), pad)
TEMPLATES = {
    "qwen2": (_QWEN25, CHATML, None, "<|im_end|>", "<|endoftext|>"),
    "qwen3": (_QWEN3, CHATML, None, "<|im_end|>", "<|endoftext|>"),
    "qwen3_moe": (_QWEN3, CHATML, None, "<|im_end|>", "<|endoftext|>"),
    "mistral": (_MISTRAL, ["<unk>", "<s>", "</s>"], "<s>", "</s>", "<unk>"),
    "mixtral": (_MISTRAL, ["<unk>", "<s>", "</s>"], "<s>", "</s>", "<unk>"),
    "gemma2": (
        _GEMMA,
        ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<end_of_turn>",
        "<pad>",
    ),
    "phi3": (
        _PHI3,
        ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        None,
        "<|end|>",
        "<|endoftext|>",
    ),
}


def tiny(family: str, seed: int = 0, **shape):
    """A tiny random model of `family` (eager attention), weights scaled up so that its greedy
    replies do not repeat. `shape` overrides SHAPE (e.g. the tokenizer's vocab_size)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**{**SHAPE, **extra, **shape})
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config).eval()
        # A tied model's logits read the input embedding straight off the residual stream:
        # with weights scaled alike it echoes its input, so its layers get more weight.
        tied = config.tie_word_embeddings
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() > 1:
                    p.mul_((0.25 if "embed" in name else 8.0) if tied else 4.0)
    return model


def tokenizer(family: str):
    """The byte-level tokenizer (256 bytes) with `family`'s special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from train.core.base import tiny_tokenizer

    byte_vocab = {ch: i for ch, i in tiny_tokenizer().get_vocab().items() if i < 256}
    template, specials, bos, eos, pad = TEMPLATES[family]
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, chat_template=template
    )


def save_family(family: str, path: Path, seed: int = 0) -> Path:
    """A model directory as `save_pretrained` writes it: config, safetensors, tokenizer."""
    tok = tokenizer(family)
    ids = {f"{k}_token_id": getattr(tok, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    model = tiny(family, seed, vocab_size=len(tok), **ids)
    model.generation_config.update(**ids)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
