"""The mask token of the parallel drafters: the token whose embedding fills the draft positions
that have no real token yet (P-EAGLE's later positions).

Engines read the mask as a token id of the target's vocabulary (vLLM: `mask_token_id` in the
draft's config) and look its embedding up in the embedding the drafter uses, so the id must have
a row there. The rule, first that applies:
1. the id the user gives (head.mask_token_id);
2. the tokenizer's own mask token;
3. the first embedding row past the tokenizer's tokens (a padded vocabulary's spare row: never a
   real token, so its embedding means nothing else);
4. the last added special token that is not bos/eos/pad/unk and that the chat template never
   writes (SmolLM2: `<empty_output>`, a code-data marker no chat produces).
"""

from __future__ import annotations

from ..errors import SpecHeadsError


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: int | None = None) -> int:
    """The mask token id for a target whose embedding has `vocab_size` rows (the rule above)."""
    if requested is not None:
        if not 0 <= requested < vocab_size:
            raise SpecHeadsError(
                f"head.mask_token_id {requested} is outside the target's vocabulary 0..{vocab_size - 1}"
            )
        return int(requested)
    own = getattr(tokenizer, "mask_token_id", None)
    if own is not None and 0 <= own < vocab_size:
        return int(own)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = " ".join(template.values()) if isinstance(template, dict) else ""
    reserved = {
        getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    unused = [
        i
        for i, token in sorted(added.items())
        if getattr(token, "special", True)
        and i not in reserved
        and i < vocab_size
        and str(getattr(token, "content", token)) not in template
    ]
    if unused:
        return int(unused[-1])
    raise SpecHeadsError(
        "no unused token to serve as the mask token (no tokenizer mask token, no spare embedding row, "
        "no unused special token): set head.mask_token_id to a token id the target never writes"
    )
