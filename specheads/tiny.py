"""Seeded tiny random-weight targets and a byte-level chat tokenizer, built in-process.

Used by `model=tiny-random` smoke runs and by the tests: no download, same weights every time.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from .errors import SpecHeadsError

# model.path=tiny:<type> names a tiny target (specheads.target loads it)
TINY_PREFIX = "tiny:"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML with Qwen3's thinking switch: enable_thinking=false puts an empty reasoning block before
# every answer and after the generation prompt (`model.tiny.template=thinking`, for model.thinking)
THINKING_TEMPLATE = (
    "{% set no_thinking = enable_thinking is defined and enable_thinking is false %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and no_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if no_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
TEMPLATES = {"chatml": CHATML_TEMPLATE, "thinking": THINKING_TEMPLATE}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB = 256

# Architecture -> (model_type, extra config fields). All share the same small sizes; the extras
# shrink each family's own parts (experts, MLA ranks, Mamba and linear-attention heads) to match, and
# give the sliding-window and chunked types a window of 8, shorter than a test's prompt and answer.
_EXPERTS = {"num_experts_per_tok": 2}
ARCHITECTURES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"use_sliding_window": False}),
    "qwen3": ("qwen3", {"use_sliding_window": False}),
    "gemma": ("gemma", {"hidden_act": "gelu_pytorch_tanh"}),
    # mixture-of-experts
    "qwen3_moe": (
        "qwen3_moe",
        {"use_sliding_window": False, "num_experts": 4, "moe_intermediate_size": 32, **_EXPERTS},
    ),
    "mixtral": ("mixtral", {"sliding_window": None, "num_local_experts": 4, **_EXPERTS}),
    "deepseek_v3": (  # MLA attention, shared + routed experts, the first layer dense
        "deepseek_v3",
        {
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "head_dim": 8,  # the RoPE part of a head
            "num_key_value_heads": 4,  # MLA: a key per query head
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            **_EXPERTS,
        },
    ),
    # sliding-window or chunked layers (some with experts)
    "gpt_oss": (  # sliding and full layers in turn, attention sinks, YaRN
        "gpt_oss",
        {
            "sliding_window": 8,
            "num_local_experts": 4,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 150000.0,
            },
            **_EXPERTS,
        },
    ),
    "llama4_text": (  # chunked layers with RoPE, full ones without (every 2nd), experts every 2nd
        "llama4_text",
        {
            "attention_chunk_size": 8,
            "no_rope_layer_interval": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,
            "intermediate_size_mlp": 128,
        },
    ),
    "gemma3_text": (  # sliding and full layers in turn
        "gemma3_text",
        {
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "phi3": ("phi3", {"sliding_window": 8}),  # every layer sliding
    # dense, full attention
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", {"use_sliding_window": False, "no_rope_layer_interval": 2}),  # every 2nd layer without RoPE
    # hybrids: layers with a recurrent state beside attention ones
    "qwen3_next": (  # Gated DeltaNet linear attention and full attention in turn, experts
        "qwen3_next",
        {
            "full_attention_interval": 2,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            **_EXPERTS,
        },
    ),
    "falcon_h1": (  # Mamba-2 and attention side by side in every layer
        "falcon_h1",
        {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16},
    ),
    "granitemoehybrid": (  # Mamba-2 layers and attention layers in turn, experts
        "granitemoehybrid",
        {
            "layer_types": ["linear_attention", "full_attention"],  # a pattern, repeated
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            "mamba_chunk_size": 16,
            "num_local_experts": 4,
            "shared_intermediate_size": 64,
            **_EXPERTS,
        },
    ),
}


def byte_tokenizer(template: str = "chatml") -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens + ChatML specials) with a chat template (TEMPLATES)."""
    if template not in TEMPLATES:
        raise SpecHeadsError(f"unknown tiny chat template {template!r}; choose from {sorted(TEMPLATES)}")
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
    fast.chat_template = TEMPLATES[template]
    return fast


def tiny_config(arch: str = "llama", **overrides):
    if arch not in ARCHITECTURES:
        raise SpecHeadsError(
            f"unknown tiny target type {arch!r} (model.path={TINY_PREFIX}{arch}); the tiny types: "
            + ", ".join(f"{TINY_PREFIX}{a}" for a in sorted(ARCHITECTURES))
        )
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
    if "layer_types" in extra and "layer_types" not in overrides:  # a pattern: repeated over the layers
        pattern = extra["layer_types"]
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(fields["num_hidden_layers"])]
    if fields["vocab_size"] < tok_vocab:
        raise SpecHeadsError(f"tiny vocab_size must be >= {tok_vocab} for the byte tokenizer (model.tiny.vocab_size)")
    return AutoConfig.for_model(model_type, **fields)


def tiny_target(arch: str = "llama", seed: int = 0, init_std: float = 0.3, template: str = "chatml", **overrides):
    """A seeded random model of `arch`; a large init std gives peaked, non-trivial distributions.
    `template` names its tokenizer's chat template (TEMPLATES)."""
    config = tiny_config(arch, **overrides)
    config.initializer_range = init_std
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model.float().eval(), byte_tokenizer(template)
