"""infer.py's settings as the generation loop's inputs: prompt token ids, EOS ids, a SamplingConfig."""

from __future__ import annotations

from collections.abc import Sequence

from ..chat_template import apply_chat
from ..config.infer import InferJobConfig
from ..decode.generate import SamplingConfig


def encode_prompt(tokenizer, text: str, system: str | None = None, chat: bool = True) -> list[int]:
    """Token ids of one user turn (chat template with the generation prompt), or the raw text."""
    return encode_turns(tokenizer, [text], [], system, chat)


def encode_turns(
    tokenizer, user_turns: list[str], answers: list[str], system: str | None = None, chat: bool = True
) -> list[int]:
    """Token ids of a conversation that ends with a user turn: user_turns[k] answered by answers[k]
    for every k before the last (chat template with the generation prompt), or the raw text."""
    if len(answers) != len(user_turns) - 1:
        raise ValueError(f"{len(user_turns)} user turns need {len(user_turns) - 1} answers, got {len(answers)}")
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system}] if system else []
        for k, text in enumerate(user_turns):
            messages.append({"role": "user", "content": text})
            if k < len(answers):
                messages.append({"role": "assistant", "content": answers[k]})
        out = apply_chat(tokenizer, messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]
    text = "\n".join(t for pair in zip(user_turns, [*answers, ""]) for t in pair if t)
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


def sampling_config(settings: InferJobConfig, max_new_tokens: int, eos: Sequence[int]) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        acceptance=settings.acceptance,
        typical_epsilon=settings.typical_epsilon,
        typical_alpha=settings.typical_alpha,
        eos_token_ids=list(eos),
    )
