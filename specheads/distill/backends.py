"""Who writes the target's answers: the target loaded here (`hf`) or a server serving it (`server`).

Both answer a batch of conversations with `answer(conversations, seed, desc)` ->
[Answer(text, finished, tokens)] (None where a server refused that request), greedy by default,
so regeneration (specheads.distill.regenerate) is the same loop whichever writes. Only `hf` can
write prompts (Magpie) and follow-up user turns: a chat server answers conversations, it does not
continue a raw user-turn prefix.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

from transformers import AutoConfig

from ..config.distill import DistillConfig
from ..config.model import ModelConfig
from ..data.chat import render
from ..errors import SpecHeadsError, first_line
from ..target import TargetInfo, load_tokenizer, target_source
from .generation import generate
from .identity import weights_for_check
from .prompts import end_of_turn_ids, pad_token_id
from .server import ServerBackend

BACKENDS = ("hf", "server")


class Answer(NamedTuple):
    text: str
    finished: bool  # ended its turn (False: cut off by max_new_tokens)
    tokens: int  # tokens written, the end-of-turn token included when there is one


class HFBackend:
    """The loaded target's batched generation loop (specheads.distill.generation)."""

    name = "hf"

    def __init__(self, target, cfg: DistillConfig):
        self.target, self.cfg = target, cfg

    def describe(self) -> dict:
        return {"backend": self.name}

    def answer(self, conversations: list[list[dict]], seed: int, desc: str | None = None) -> list[Answer]:
        tokenizer, model = self.target.tokenizer, self.target.model
        ids = [
            tokenizer(render(tokenizer, c, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for c in conversations
        ]
        outs = generate(
            model,
            ids,
            max_new_tokens=self.cfg.max_new_tokens,
            stop_ids=end_of_turn_ids(tokenizer, model),
            pad_id=pad_token_id(tokenizer),
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            batch_size=self.cfg.batch_size,
            seed=seed,
            desc=desc,
        )
        return [
            Answer(tokenizer.decode(o.tokens, skip_special_tokens=True), o.finished, len(o.tokens) + int(o.finished))
            for o in outs
        ]


class RemoteBackend:
    """ServerBackend behind the same interface, connected and checked against the target."""

    name = "server"

    def __init__(self, target, cfg: DistillConfig):
        self.server = ServerBackend(cfg.server, target.tokenizer, cfg.max_new_tokens, cfg.temperature, cfg.top_p)
        self.identity = cfg.server.identity
        weights, self.not_compared = None, None
        if self.identity != "tokenizer":
            weights, self.not_compared = weights_for_check(target, self.identity)
            if weights is None:
                print(
                    f"warning: distill.server.identity=auto: the served model's weights are not compared with "
                    f"the target's, only its tokenizer and chat template ({self.not_compared}); "
                    "distill.server.identity=logprobs loads it anyway",
                    file=sys.stderr,
                )
        self.served = self.server.connect(target.info.name, weights)
        del weights  # loaded for the check only, where the target had none here
        served = self.served
        print(f"server: {served.url} serves {served.model!r}; identity checked by {served.describe_check()}")

    def describe(self) -> dict:
        served = self.served
        server = {
            "model": served.model,
            "engine": served.engine,
            # "logprobs": the weights were compared; "tokenizer": only the tokenizer and chat template
            "check": served.check,
            "identity": self.identity,
            "tokenizer_check": served.tokenizer_check,
        }
        if served.logprobs is not None:
            server["logprobs"] = served.logprobs
        if self.not_compared is not None:
            server["weights_not_compared"] = self.not_compared
        return {
            "backend": self.name,
            "server": {**server, "sampling": self.server.sampling(), **self.server.template_fields()},
        }

    def answer(self, conversations: list[list[dict]], seed: int, desc: str | None = None) -> list[Answer | None]:
        """None for a conversation the server refused (ServerBackend._one)."""
        return [None if reply is None else Answer(*reply) for reply in self.server.answer(conversations, seed, desc)]


def make_backend(target, cfg: DistillConfig):
    if cfg.backend == "hf":
        return HFBackend(target, cfg)
    if cfg.backend == "server":
        return RemoteBackend(target, cfg)
    raise SpecHeadsError(f"unknown distill.backend={cfg.backend!r}; use one of {list(BACKENDS)}")


@dataclass
class TokenizerTarget:
    """The target as far as a server backend needs it: tokenizer and sizes, no weights loaded
    (a 70B target is served elsewhere; loading it here only to read its tokenizer would not fit)."""

    tokenizer: object
    info: TargetInfo
    model: None = None
    source: ModelConfig | None = None  # where the weights are, for distill.server.identity=logprobs


def load_tokenizer_target(cfg: ModelConfig) -> TokenizerTarget:
    tokenizer = load_tokenizer(cfg)
    source, kwargs = target_source(cfg)
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:
        first = first_line(err)
        raise SpecHeadsError(f"cannot load the tokenizer of target {cfg.path!r}: {first}") from err
    info = TargetInfo.from_hf_config(config, name=cfg.name, revision=cfg.revision)
    return TokenizerTarget(tokenizer, info, source=cfg)
