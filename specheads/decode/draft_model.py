"""A separate draft model: a small causal LM with the target's tokenizer drafts for it (the original
speculative decoding of Leviathan et al. and Chen et al., 2023; transformers' assisted generation with
`assistant_model`; vLLM's "draft_model" method).

Loading (`load_draft_model`): a Hub id or a local directory through transformers (or, as for the
target, embedded:smollm2 or a .gguf file). Refused in one line when it is not a causal LM, or when
its tokenizer maps tokens to ids otherwise than the target's: the ids are what the draft reads and
proposes, so that mapping, added and special tokens included, must be the same; which special
token ends a turn may differ (a base model drafting for its instruct model), and the draft's
embedding may have more rows than the tokenizer has tokens (padded vocabularies): it drafts among
the ids both models have.

Drafting (`DraftModelDrafter`, the drafter protocol of drafters.py; it reads no target state):
the draft model keeps its own transformers KV cache (kv.new_cache). Between steps the cache holds
the committed sequence (the prompt and the answer so far) less the tokens not fed yet; draft()
feeds them first (the whole prompt at the first step: the draft's prefill is part of the first
step's drafting time), so that the cache then holds the committed sequence up to and including
the root, one entry per position. The tree grows level by level (drafters.grow_tree): each level's
nodes run through the draft model in one forward at their RoPE positions (prefix + depth), each
seeing the committed sequence, its ancestors and itself through a tree attention mask
(kv.tree_attention_masks: each layer's own, a sliding-window layer's window counted in the
positions of its key slots, as the target's verification counts it), their keys and values
appended after the committed entries. The drafted entries are cropped before draft() returns, and
advance() queues the accepted tokens and the bonus token to be fed at the next draft, so the cache
is again exactly the committed sequence, as if the draft model had read it one token at a time. A
chain of K drafts is the static tree of K top-1 ranks; static, dynamic (EAGLE-2) and chain policies
all work.

Drafts are the draft model's top-ranked tokens (deterministic), so the verify rules treat them as
one-hot proposals: greedy output is the target's own, and sampling follows the target's distribution
(decode/verify.py), as for every drafter here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config.infer import DraftModelConfig
from ..config.model import ModelConfig
from ..errors import SpecHeadsError
from ..numerics import relative_error, same_numbers
from ..target import FrozenTarget, target_source
from .drafters import DraftTable, grow_tree
from .kv import cache_length, compact_cache, new_cache, tree_attention_masks
from .policy import TreePolicy
from .tree import TreeLayout

# written beside a draft that make_draft_model cut from a target: where its layers came from
MADE_FROM_FILE = "specheads_draft.json"


@dataclass
class DraftModel:
    """A loaded draft model: the transformers causal LM, its tokenizer and what the benchmark
    reports of it."""

    model: Any  # a transformers causal LM (eval mode, frozen)
    tokenizer: Any
    name: str  # draft.model as given
    vocab_size: int  # the ids it drafts among: those both the draft and the target have

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def describe(self) -> dict[str, Any]:
        """The summary's record of the draft model."""
        config = self.model.config.get_text_config()
        return {
            "model": self.name,
            "model_type": config.model_type,
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "dtype": str(self.dtype).removeprefix("torch."),
            "made_from": getattr(self.model, "specheads_made_from", None),
        }


def check_tokenizers(target_tok, draft_tok, name: str) -> None:
    """Refuse a draft whose tokenizer maps tokens to ids otherwise than the target's."""
    if draft_tok is None:
        raise SpecHeadsError(
            f"draft.model={name} has no tokenizer: its token ids cannot be checked against the target's"
        )
    theirs, ours = draft_tok.get_vocab(), target_tok.get_vocab()
    if theirs == ours:
        return
    differ = next((t for t in sorted(ours, key=ours.get) if theirs.get(t) != ours[t]), None)
    if differ is None:
        differ = next(t for t in sorted(theirs, key=theirs.get) if t not in ours)
    where = f"{differ!r} is id {theirs.get(differ)} there and {ours.get(differ)} in the target's"
    raise SpecHeadsError(
        f"draft.model={name} has another tokenizer than the target ({len(theirs)} tokens against {len(ours)}; "
        f"{where}): a draft model must share the target's token ids"
    )


def draft_source(cfg: DraftModelConfig) -> tuple[Any, dict[str, Any]]:
    """Where transformers loads the draft from, and the from_pretrained arguments (as for a target)."""
    model_cfg = ModelConfig(
        name=cfg.model, path=cfg.model, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
    )
    return target_source(model_cfg)


def load_draft_model(cfg: DraftModelConfig, target: FrozenTarget) -> DraftModel:
    """Load draft.model for `target` (its device, draft.dtype), refused in one line when it is not a
    causal LM or its tokenizer is not the target's."""
    import json
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    name = cfg.model
    if not name:
        raise SpecHeadsError("no draft model: give draft.model=NAME_OR_DIR")
    source, kwargs = draft_source(cfg)
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as err:
        raise SpecHeadsError(f"cannot load draft.model={name}: {_first_line(err)}") from err
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or getattr(config, "is_encoder_decoder", False):
        raise SpecHeadsError(f"draft.model={name} is a {config.model_type!r} model, not a causal LM")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, TypeError) as err:
        raise SpecHeadsError(f"draft.model={name} has no tokenizer that loads ({_first_line(err)})") from err
    check_tokenizers(target.tokenizer, tokenizer, name)
    dtype = target.dtype if cfg.dtype == "target" else getattr(torch, cfg.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except (OSError, ValueError) as err:
        raise SpecHeadsError(f"cannot load draft.model={name}: {_first_line(err)}") from err
    model = model.to(target.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    rows = model.get_input_embeddings().num_embeddings
    if rows < len(tokenizer):
        raise SpecHeadsError(f"draft.model={name} embeds {rows} ids but its tokenizer has {len(tokenizer)} tokens")
    made_from = Path(str(source)) / MADE_FROM_FILE
    if made_from.is_file():
        model.specheads_made_from = json.loads(made_from.read_text())
    draft = DraftModel(model, tokenizer, name, min(model.get_output_embeddings().out_features, target.info.vocab_size))
    new_cache(model)  # refuses a recurrent-state (hybrid) cache now, not at the first draft
    return draft


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class DraftModelDrafter:
    """Drafts with a separate causal LM and its own KV cache (module docstring)."""

    layer_ids: list[int] = []  # reads no target state
    reads_final = False
    head = None  # not a head: nothing calibrated, no draft precision of a head's

    def __init__(self, draft: DraftModel, policy: TreePolicy):
        self.draft_model = draft
        self.model = draft.model
        self.policy = policy
        self.vocab = draft.vocab_size
        self.cache = None
        self.pending: list[int] = []  # committed tokens not fed to the draft model yet
        self.last_fed: list[int] = []
        self.table: DraftTable | None = None  # every node the last draft() drafted (grow_tree)

    def start(self, prompt_ids: torch.Tensor, states: dict, root: int) -> None:
        self.cache = new_cache(self.model)
        self.pending = [int(t) for t in prompt_ids[0].tolist()] + [int(root)]
        self.last_fed = []

    def advance(self, states: dict, tokens: Sequence[int], bonus: int) -> None:
        # tokens[0] is the root, already fed by draft(); a step drafted without this drafter left it queued
        self.pending += [int(t) for t in tokens[1:]] + [int(bonus)]

    def rewind(self, n: int) -> None:
        """Forget the last n fed tokens and queue them again (to time or repeat a drafting step)."""
        n = min(n, len(self.last_fed))
        if n:
            compact_cache(self.cache, cache_length(self.cache) - n, [])
            self.pending = self.last_fed[-n:] + self.pending

    def _forward(self, ids: list[int], positions: list[int], mask: torch.Tensor | None, last_only: bool):
        device = self.draft_model.device
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            attention_mask=mask,
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return torch.log_softmax(out.logits[0, :, : self.vocab].float(), dim=-1)

    def _catch_up(self, prefix_len: int) -> torch.Tensor:
        """Feed the queued tokens (the last one is the root, at position prefix_len); returns the
        draft model's log-probs of the root's next token."""
        if not self.pending:
            raise RuntimeError("draft() called twice without advance() or rewind()")
        ids, self.pending = self.pending, []
        self.last_fed = ids
        first = prefix_len + 1 - len(ids)
        return self._forward(ids, list(range(first, prefix_len + 1)), None, last_only=True)[-1]

    def _crop(self, stable: int) -> None:
        """Drop the drafted entries: the cache holds the committed sequence up to the root again."""
        compact_cache(self.cache, stable, [])

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        root_logp = self._catch_up(prefix_len)
        stable = cache_length(self.cache)  # the committed sequence, root included
        dtype, device = self.draft_model.dtype, self.draft_model.device
        slot: dict[int, int] = {}  # node id -> its cache slot
        slot_positions: list[int] = []  # the RoPE position of every drafted slot, in slot order

        def child_logp(ids: list[int], table: DraftTable) -> torch.Tensor:
            new = [i for i in ids if i != 0]
            rows: dict[int, torch.Tensor] = {0: root_logp}
            if new:
                n, past = len(new), cache_length(self.cache)
                seen = torch.zeros(n, past - stable + n, dtype=torch.bool)
                for r, i in enumerate(new):
                    seen[r, past - stable + r] = True
                    a = table.parents[i]
                    while a > 0:
                        seen[r, slot[a] - stable] = True
                        a = table.parents[a]
                positions = [prefix_len + table.depths[i] for i in new]
                slot_positions.extend(positions)
                # a chain's one query sees every slot: the model's own masks, counting slots, count its positions
                mask = None
                if not (n == 1 and bool(seen.all())):
                    mask = tree_attention_masks(self.model.config, seen, stable, dtype, device, slot_positions)
                logp = self._forward([table.tokens[i] for i in new], positions, mask, last_only=False)
                for r, i in enumerate(new):
                    slot[i] = past + r
                    rows[i] = logp[r]
            return torch.stack([rows[i] for i in ids])

        try:
            self.table = DraftTable()
            return grow_tree(root, child_logp, lambda ids: ids, self.policy, max_depth, self.table)
        finally:
            self._crop(stable)


def first_layers_logits(target: FrozenTarget, input_ids: torch.Tensor, layers: int) -> torch.Tensor:
    """The logits of the target's first `layers` decoder layers, its final norm and its LM head
    (what a draft cut by make_draft_model computes): the residual stream entering layer `layers`,
    normed and projected."""
    states = target.states(input_ids, layer_ids=[layers], final=False)
    return target.lm_head(target.final_norm(states.hidden[layers]))


def make_draft_model(target: FrozenTarget, layers: int, out):
    """Write the target's first `layers` decoder layers with its embedding, final norm and LM head
    as a standalone transformers model directory at `out` (config.json with num_hidden_layers =
    layers, model.safetensors, the target's tokenizer, and MADE_FROM_FILE saying where it came
    from), atomically; checked before it is put in place: it loads with AutoModelForCausalLM and its
    logits equal first_layers_logits of the target. Returns the directory."""
    import copy
    import json

    from transformers import AutoModelForCausalLM

    from ..atomic import write_directory

    total = target.info.num_layers
    if not 1 <= layers < total:
        raise SpecHeadsError(f"a draft cut from a {total}-layer target keeps 1..{total - 1} layers, not {layers}")
    model = target.model
    config = copy.deepcopy(model.config)
    text = config.get_text_config()
    text.num_hidden_layers = layers
    for key in ("layer_types", "mlp_layer_types"):  # per-layer lists (sliding/full attention, ...)
        if isinstance(getattr(text, key, None), list):
            setattr(text, key, getattr(text, key)[:layers])
    prefix = next(name for name, module in model.named_modules() if module is target.layers) + "."
    kept = {}
    for key, value in model.state_dict().items():
        if key.startswith(prefix) and int(key[len(prefix) :].split(".")[0]) >= layers:
            continue
        kept[key] = value
    draft = AutoModelForCausalLM.from_config(config).to(dtype=target.dtype)
    draft.load_state_dict(kept, strict=True)
    draft.generation_config = copy.deepcopy(model.generation_config)
    record = {
        "target": target.info.name,
        "source": target.loaded.get("source", target.info.name),
        "layers": layers,
        "target_layers": total,
        "kept": f"embedding, decoder layers 0..{layers - 1}, final norm, LM head",
    }

    def fill(tmp):
        draft.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        (tmp / MADE_FROM_FILE).write_text(json.dumps(record, indent=2) + "\n")

    def check(tmp):
        loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=target.dtype).to(target.device).eval()
        ids = torch.arange(min(16, target.info.vocab_size), device=target.device)[None] % target.info.vocab_size
        with torch.no_grad():
            mine, ref = loaded(ids).logits.float(), first_layers_logits(target, ids, layers).float()
        if not same_numbers(mine, ref, target.dtype):
            raise RuntimeError(
                f"the saved draft's logits differ from the target's first {layers} layers by "
                f"{relative_error(mine, ref):.2g} of their magnitude"
            )

    return write_directory(out, fill, check)
