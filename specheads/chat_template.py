"""The chat template's variables (model.thinking) resolved once on the target's tokenizer, the one
rendering call every chat goes through, and the record of a rendering that data and heads carry.

It sits beside the target (specheads.target resolves the setting when it loads the tokenizer) so that
every layer above renders alike; specheads.data.chat builds the loss masks on top of it.
"""

from __future__ import annotations

import hashlib
import json
import sys

# The tokenizer attribute holding the variables the chat template renders with (model.thinking):
# set once where the target's tokenizer is loaded (specheads.target), read by every rendering
# through apply_chat, so that data, distillation and inference render alike.
CHAT_KWARGS = "specheads_chat_kwargs"
THINKING_VARIABLE = "enable_thinking"  # Qwen3's name for it, which vLLM and SGLang pass on too
# what a chat record renders to tell two settings apart: a past answer and a generation prompt
CHAT_PROBE = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


def template_text(tokenizer) -> str:
    """The tokenizer's chat template as text ("" for none; a dict of named templates as JSON)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def set_thinking(tokenizer, thinking: bool | None) -> None:
    """Resolve model.thinking on the target's tokenizer: None leaves the template its default; a
    template that never reads enable_thinking is told so in one line, since the setting then does nothing."""
    kwargs = {} if thinking is None else {THINKING_VARIABLE: bool(thinking)}
    setattr(tokenizer, CHAT_KWARGS, kwargs)
    if kwargs and THINKING_VARIABLE not in template_text(tokenizer):
        print(
            f"warning: model.thinking={str(bool(thinking)).lower()}: the target's chat template does not read "
            f"{THINKING_VARIABLE}, so it renders as it always does",
            file=sys.stderr,
        )


def template_kwargs(tokenizer) -> dict:
    """The variables the target's chat template renders with ({} for its defaults)."""
    return dict(getattr(tokenizer, CHAT_KWARGS, None) or {})


def thinking_of(tokenizer) -> bool | None:
    return template_kwargs(tokenizer).get(THINKING_VARIABLE)


def apply_chat(tokenizer, messages: list[dict], **kwargs):
    """tokenizer.apply_chat_template with the target's template variables: every chat rendering
    of specheads goes through here."""
    return tokenizer.apply_chat_template(messages, **{**template_kwargs(tokenizer), **kwargs})


# -- the chat record: which template and setting rendered a data set or a head's training data -----


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def chat_record(tokenizer) -> dict | None:
    """What distilled data and trained heads record of the chat rendering they were made with: the
    template's sha256, model.thinking, and the sha256 of a probe rendered with both (so that a
    setting rendering as the template's default counts as the same). None without a template."""
    template = template_text(tokenizer)
    if not template:
        return None
    try:
        probe = _sha256(apply_chat(tokenizer, CHAT_PROBE, tokenize=False, add_generation_prompt=True))
    except Exception:  # a template that refuses the probe (its own role rules) still records its text
        probe = None
    return {"template_sha256": _sha256(template), "thinking": thinking_of(tokenizer), "probe_sha256": probe}


def describe_chat(record: dict | None) -> str:
    """One phrase naming a chat rendering, e.g. "chat template 1a2b3c4d5e6f, thinking off"."""
    if not record:
        return "no chat template"
    thinking = {None: "at the template's default", True: "on", False: "off"}.get(record.get("thinking"), "?")
    return f"chat template {str(record.get('template_sha256'))[:12]}, thinking {thinking}"


def same_rendering(recorded: dict, now: dict | None, tokenizer) -> bool:
    """The same template, and a thinking setting that is the same, that the template does not read,
    or that renders the probe alike (None where the template's default is on)."""
    if now is None or recorded.get("template_sha256") != now["template_sha256"]:
        return False
    if recorded.get("thinking") == now["thinking"] or THINKING_VARIABLE not in template_text(tokenizer):
        return True
    return now["probe_sha256"] is not None and recorded.get("probe_sha256") == now["probe_sha256"]


def chat_mismatch(recorded: dict | None, tokenizer, made: str, here: str) -> str | None:
    """One line when the tokenizer renders otherwise than `recorded`; None when they agree or nothing
    was recorded (data and heads made before the record). `made` and `here` begin the two halves,
    e.g. "data DIR was made with" and "this run renders with"."""
    if not recorded:
        return None
    now = chat_record(tokenizer)
    if same_rendering(recorded, now, tokenizer):
        return None
    same_template = now is not None and recorded.get("template_sha256") == now["template_sha256"]
    fix = f"; set model.thinking={json.dumps(recorded.get('thinking'))} to match" if same_template else ""
    return (
        f"{made} {describe_chat(recorded)}, but {here} {describe_chat(now)}: a head is accepted less "
        f"when served otherwise than it was trained{fix}"
    )
