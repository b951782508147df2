"""infer.py's demo: answer one prompt with speculative decoding, streamed, with the drafted-and-
accepted tokens marked, then a stats line (tau, tokens/s, speedup over plain decoding)."""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from ..config.infer import InferJobConfig
from ..decode.baselines import hf_generate
from ..decode.generate import speculative_generate
from ..decode.policy import describe_policy, plan_drafts
from ..target import eos_token_ids
from .inputs import encode_prompt, sampling_config
from .session import method_drafter


class TokenPrinter:
    """Streams decoded text; tokens drafted (by the head or the draft model) and accepted by the target are marked.

    Text is re-decoded from the start for every token so that byte-level tokens that split a
    character come out right (a piece ending in an incomplete character waits for the next).
    """

    MARKS = {"ansi": ("\x1b[1;32m", "\x1b[0m"), "brackets": ("«", "»"), "none": ("", "")}

    def __init__(self, tokenizer, style: str = "auto", out: TextIO | None = None):
        out = sys.stdout if out is None else out  # at the call: a caller may have redirected it since import
        if style == "auto":
            style = "ansi" if out.isatty() else "brackets"
        self.open, self.close = self.MARKS[style]
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = ""
        self.marking = False

    def legend(self) -> str:
        if not self.open:
            return ""
        return f"{self.open}marked{self.close} = drafted and accepted by the target"

    def __call__(self, ids: list[int], drafted: list[bool]) -> None:
        for token, flag in zip(ids, drafted):
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd") or not text.startswith(self.printed):
                continue
            piece, self.printed = text[len(self.printed) :], text
            if not piece:
                continue
            if flag and not self.marking:
                self.out.write(self.open)
            elif not flag and self.marking:
                self.out.write(self.close)
            self.marking = flag
            self.out.write(piece)
        self.out.flush()

    def finish(self) -> None:
        if self.marking:
            self.out.write(self.close)
            self.marking = False
        self.out.write("\n")
        self.out.flush()


def run_demo(settings: InferJobConfig, session, out: TextIO | None = None) -> dict:
    """Answer one prompt with speculative decoding; print it marked, then a stats line.

    Args:
        settings: infer.py's validated settings, with `prompt` set.
        session: the loaded target and head, or without a head its draft model
            (specheads.bench.session.load_session).
        out: where the answer and the stats line are printed (None: sys.stdout at the call).

    Returns:
        The stats: tau, tokens/s, and with `compare=true` plain decoding's speed and the speedup.
    """
    out = sys.stdout if out is None else out
    target, head = session.target, session.head
    ids = encode_prompt(target.tokenizer, settings.prompt, settings.system, settings.chat)
    prompt = torch.tensor([ids], device=target.device)
    eos = eos_token_ids(target)
    cfg = sampling_config(settings, settings.max_new_tokens, eos)
    method = "spec" if head is not None else "draft" if session.draft is not None else "skip"
    plan = plan_drafts(head, settings.tree, () if method == "skip" else (method,))
    drafter, policy, _ = method_drafter(session, method, plan)
    if method == "spec":
        who = f"{head.family} head"
    elif method == "draft":  # no head: the separate draft model drafts (draft.model)
        who = f"draft model {session.draft.name}"
    else:  # nor a draft model: the target with layers skipped (skip.layers)
        who = f"target skipping layers {list(session.skip.layers)}"
    gen = torch.Generator(device=target.device).manual_seed(settings.seed)
    # warm-up (first calls pay for lazy initialisation), not timed
    warm = sampling_config(settings, 4, eos)
    speculative_generate(target, drafter, prompt, warm, generator=gen)
    if settings.compare:
        hf_generate(target, prompt, warm)
    printer = TokenPrinter(target.tokenizer, settings.mark, out)
    res = speculative_generate(target, drafter, prompt, cfg, on_step=printer, generator=gen)
    printer.finish()
    stats = {
        "new_tokens": res.new_tokens,
        "target_forwards": res.target_forwards,
        "tau": res.tau,
        "tokens_per_s": res.new_tokens / res.wall_s if res.wall_s else 0.0,
    }
    line = (
        f"[{who}, {describe_policy(policy)}] tau {res.tau:.2f} | "
        f"{stats['tokens_per_s']:.1f} tokens/s | {res.new_tokens} tokens, {res.target_forwards} target forwards"
    )
    if settings.compare:
        torch.manual_seed(settings.seed)
        base = hf_generate(target, prompt, cfg)
        base_tps = len(base["output_ids"]) / base["wall_s"] if base["wall_s"] else 0.0
        stats["baseline_tokens_per_s"] = base_tps
        stats["speedup"] = stats["tokens_per_s"] / base_tps if base_tps else 0.0
        line += f" | speedup {stats['speedup']:.2f}x vs plain decoding ({base_tps:.1f} tokens/s)"
        if settings.temperature <= 0:
            same = base["output_ids"] == res.output_ids
            stats["identical_to_baseline"] = same
            line += f" | identical to plain greedy: {'yes' if same else 'NO'}"
    legend = printer.legend()
    if legend:
        out.write(legend + "\n")
    out.write(line + "\n")
    out.flush()
    return stats
