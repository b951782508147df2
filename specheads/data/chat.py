"""Chat rendering and the assistant-only loss mask, for any chat template.

The loss mask is found on the rendered text: each message's content is located in the rendered
conversation (anchored by rendering the conversation prefix by prefix), and the tokenizer's
offset mapping turns those character spans into token spans.
"""

from __future__ import annotations

from ..chat_template import apply_chat
from ..errors import SpecHeadsError
from .formats import Conversation


def render(tokenizer, messages: Conversation, add_generation_prompt: bool = False) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise SpecHeadsError("the tokenizer has no chat template; set one on the target's tokenizer")
    return apply_chat(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: Conversation) -> tuple[str, list[tuple[int, int]], list[int]]:
    """The rendered conversation, the character span of every assistant message's content, and
    the index of the message each span belongs to."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = render(tokenizer, plain)
    spans, owners, cursor = [], [], 0
    for i, message in enumerate(messages):
        anchored = False
        if message["role"] == "assistant":
            # Anchor the search after the generation prompt, so a short answer ("user") cannot
            # be matched inside the template's own header text.
            prefix = render(tokenizer, plain[:i], add_generation_prompt=True) if i else ""
            if prefix and text.startswith(prefix):
                cursor, anchored = max(cursor, len(prefix)), True
        content = message["content"]
        if not content.strip():
            if anchored:  # an empty answer still ends its turn: train on the end token
                spans.append((cursor, cursor))
                owners.append(i)
            continue
        start = text.find(content, cursor)
        if start < 0:  # some templates strip the content
            content = content.strip()
            start = text.find(content, cursor)
        if start < 0:  # the template rewrote this message: it gets no loss (rows left with
            continue  # no assistant token at all are dropped by build_datasets)
        end = start + len(content)
        if message["role"] == "assistant":
            spans.append((start, end))
            owners.append(i)
        cursor = end
    return text, spans, owners


def tokenize_conversation(tokenizer, messages: Conversation, max_length: int) -> dict[str, list[int]]:
    """Chat-template token ids and a mask that is 1 exactly on assistant content + its end token."""
    text, spans, owners = assistant_char_spans(tokenizer, messages)
    # a cut-off answer keeps its loss on the content but not on the end token after it
    cut = [bool(messages[i].get("truncated")) for i in owners]
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    else:
        ids, offsets = _tokenize_pieces(tokenizer, text, spans)
    end_ids = special_token_ids(tokenizer)
    mask = [0] * len(ids)
    k = 0
    for n, (start, end) in enumerate(spans):
        while k < len(ids) and offsets[k][1] <= start:
            k += 1
        while k < len(ids) and offsets[k][0] < end:
            if offsets[k][1] > offsets[k][0]:  # zero-width tokens carry no text
                mask[k] = 1
            k += 1
        # The token that closes the turn is predicted from the answer: train on it too.
        if k < len(ids) and ids[k] in end_ids and not cut[n]:
            mask[k] = 1
            k += 1
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def special_token_ids(tokenizer) -> set[int]:
    """Special tokens (eos, <|im_end|>, <|eot_id|>, ...): the ones that may close a turn."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            ids.add(tokenizer.convert_tokens_to_ids(token.content))
    return ids


def _tokenize_pieces(tokenizer, text: str, spans: list[tuple[int, int]]):
    """Offsets for slow tokenizers: tokenize the text piecewise at the span boundaries."""
    cuts = sorted({0, len(text), *[c for span in spans for c in span]})
    ids, offsets = [], []
    for a, b in zip(cuts, cuts[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        # Spread the piece's characters over its tokens; only the piece boundary matters here.
        offsets.extend((a, b) if j == len(piece) - 1 else (a, a + 1) for j in range(len(piece)))
    return ids, offsets
