"""Seeded tiny random-weight targets and a byte-level chat tokenizer, built in-process.

Used by `model=tiny-random` smoke runs and by the tests: no download, same weights every time.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB = 256

# Architecture -> (model_type, extra config fields). All share the same small sizes.
ARCHITECTURES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),
    "qwen3": ("qwen3", {"use_sliding_window": False}),
    "gemma": ("gemma", {"hidden_act": "gelu_pytorch_tanh"}),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + ChatML specials) with a chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", **overrides):
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    model_type, extra = ARCHITECTURES[arch]
    tok_vocab = BYTE_VOCAB + len(SPECIAL_TOKENS)
    fields = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=BYTE_VOCAB + 2,
        pad_token_id=BYTE_VOCAB,
    )
    fields.update(extra)
    fields.update(overrides)
    if fields["vocab_size"] < tok_vocab:
        raise ValueError(f"tiny vocab_size must be >= {tok_vocab} for the byte tokenizer")
    return AutoConfig.for_model(model_type, **fields)


def tiny_target(arch: str = "llama", seed: int = 0, init_std: float = 0.3, **overrides):
    """A seeded random model of `arch`; a large init std gives peaked, non-trivial distributions."""
    config = tiny_config(arch, **overrides)
    config.initializer_range = init_std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.float().eval(), byte_tokenizer()
