"""Drafters: turn a draft head's predictions into a candidate tree for the target to verify.

A drafter follows the generation loop through three calls:
  start(prompt_ids, states, root)  after prefill; states = the target's captured states [1, T, .]
  draft(root, prefix_len, max_depth) -> (tokens, layout)   tokens[0] == root
  advance(states, tokens, bonus)   after verification; states and tokens of the accepted path
                                   (root first), bonus = the target's next token (the next root)
(and rewind(n), which makes the next draft() redo the work of the last n accepted tokens: used
to time drafting during tree calibration). A drafter that runs the target's own layers (early exit)
also has bind_target_cache(cache): whoever owns the target's KV cache (the generation loop) hands it
over before start(), and at every draft() it holds exactly the committed prefix.
A drafter that keeps the answers it served (the hybrid's suffix history) also has finish(tokens):
the tokens the last step committed, which no advance() follows, so its history holds the whole answer.
A drafter may also say where each node of its last tree came from (`sources`, tree.FROM_HEAD /
FROM_TEXT bits), which the loop counts for accepted nodes. Drafts are deterministic (top-k), so any
acceptance rule that treats them as one-hot proposals is lossless.

Tree growth is shared by all families (`grow_tree`): the caller provides the log-probabilities
of a node's children; the policy is a static tree of rank paths or an EAGLE-2 dynamic tree
(expand the top_k most probable paths per level, then keep the best total_tokens nodes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import SpecHeadsError
from .hybrid_rule import AdaptiveRule, Choice
from .policy import DynamicTreeSpec, HybridPolicy, TreePolicy, check_depth, policy_depth
from .suffix import SuffixIndex, TextDraft
from .target_layers import check_layer_family, crop_layers, run_layers
from .tree import FROM_HEAD, FROM_TEXT, StaticTree, TreeLayout, merge_chains, pruned_tree, select_dynamic


@dataclass
class DraftTable:
    """Every node produced while drafting: token (target vocab), parent, depth, path score."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(float(score))
        return len(self.tokens) - 1


# child_logp(ids, table) -> [len(ids), Vd] log-probs of each node's next token (draft vocab);
# to_target maps draft-vocab ids to target ids.
ChildLogp = Callable[[list[int], DraftTable], torch.Tensor]
ToTarget = Callable[[torch.Tensor], torch.Tensor]


def grow_tree(
    root: int,
    child_logp: ChildLogp,
    to_target: ToTarget,
    policy: TreePolicy,
    max_depth: int,
    table: DraftTable | None = None,
) -> tuple[list[int], TreeLayout]:
    """Draft a tree below `root` (never deeper than max_depth); returns (tokens, layout). `table`
    (an empty DraftTable) receives every node drafted, kept or not, with its path score: what tree
    calibration reads to price dynamic trees (bench/dynamic_trees.py)."""
    table = DraftTable() if table is None else table
    table.add(root, -1, 0.0)
    if max_depth < 1:
        return [root], TreeLayout((-1,))
    if isinstance(policy, StaticTree):
        return _grow_static(table, child_logp, to_target, pruned_tree(policy, max_depth))
    return _grow_dynamic(table, child_logp, to_target, policy, max_depth)


def _grow_static(
    table: DraftTable, child_logp: ChildLogp, to_target: ToTarget, tree: StaticTree
) -> tuple[list[int], TreeLayout]:
    layout = tree.layout
    depths = layout.depths
    min_logp = math.log(tree.min_path_prob) if tree.min_path_prob > 0 else -math.inf
    for d in range(1, layout.max_depth + 1):
        level = [i for i in range(layout.size) if depths[i] == d]
        parents = sorted({layout.parents[i] for i in level})
        if d > 1 and max(table.scores[p] for p in parents) < min_logp:
            # no path into this level is likely enough to pay for drafting and verifying it
            kept = pruned_tree(tree, d - 1)
            return table.tokens[: kept.size], kept.layout
        k = max(tree.ranks[i] for i in level) + 1
        logp = child_logp(parents, table)
        top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        tokens, values = to_target(top.indices).tolist(), top.values.tolist()
        row_of = {p: r for r, p in enumerate(parents)}
        for i in level:  # level nodes are consecutive, so table ids equal node ids
            parent = layout.parents[i]
            ranks, scores = tokens[row_of[parent]], values[row_of[parent]]
            rank = min(tree.ranks[i], len(ranks) - 1)
            table.add(ranks[rank], parent, table.scores[parent] + scores[rank])
    return table.tokens, layout


def _grow_dynamic(
    table: DraftTable, child_logp: ChildLogp, to_target: ToTarget, spec: DynamicTreeSpec, max_depth: int
) -> tuple[list[int], TreeLayout]:
    floor = math.log(spec.min_path_prob) if spec.min_path_prob > 0 else -math.inf
    frontier = [0]
    for _ in range(min(spec.depth, max_depth)):
        if not frontier:  # no path is likely enough to be worth another level
            break
        logp = child_logp(frontier, table)
        k = min(spec.top_k, logp.shape[-1])
        top = torch.topk(logp, k, dim=-1)
        tokens = to_target(top.indices).tolist()
        values = top.values.tolist()
        children = []
        for row, parent in enumerate(frontier):
            base = table.scores[parent]
            for j in range(k):
                children.append(table.add(tokens[row][j], parent, base + values[row][j]))
        # the next frontier: the top_k children by path score (ties to the earlier node) above the floor
        likely = [c for c in children if table.scores[c] >= floor]
        frontier = sorted(sorted(likely, key=lambda c: (-table.scores[c], c))[: spec.top_k])
    cand_parents = [p - 1 for p in table.parents[1:]]  # candidates are table ids 1.., root -> -1
    kept, layout = select_dynamic(cand_parents, table.scores[1:], spec.total_tokens, floor)
    return [table.tokens[0]] + [table.tokens[c + 1] for c in kept], layout


class MedusaDrafter:
    """Medusa: head k's top-k at the last accepted position fill depth k+1 (a Cartesian product)."""

    def __init__(self, head, policy: TreePolicy):
        self.head = head
        self.policy = policy
        self.layer_ids: list[int] = []
        self.reads_final = True
        self.final: torch.Tensor | None = None  # [1, 1, H] target state at the last accepted token
        self.table: DraftTable | None = None  # every node the last draft() drafted (grow_tree)

    def start(self, prompt_ids: torch.Tensor, states: dict, root: int) -> None:
        self.final = states["final"][:, -1:]

    def advance(self, states: dict, tokens: Sequence[int], bonus: int) -> None:
        self.final = states["final"][:, -1:]

    def rewind(self, n: int) -> None:
        """Nothing to undo: drafting reads only the last accepted state."""

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        logits = self.head.medusa_logits(self.final)  # [K, 1, 1, V]
        head_logp = torch.log_softmax(logits[:, 0, 0].float(), dim=-1)

        def child_logp(ids, table):
            return head_logp[torch.tensor([table.depths[i] for i in ids], device=head_logp.device)]

        self.table = DraftTable()
        return grow_tree(root, child_logp, lambda ids: ids, self.policy, max_depth, self.table)


class EagleDrafter:
    """EAGLE-1 / EAGLE-3: the draft decoder runs level by level over the tree with its own KV cache.

    The draft cache holds one entry per committed position i (feature of target position i,
    token i+1). Tree nodes are appended while drafting and cropped afterwards; after
    verification the accepted tokens are fed with the target's own features (`advance`).
    """

    def __init__(self, head, policy: TreePolicy):
        self.head = head
        self.policy = policy
        self.layer_ids = head.target_layer_ids()
        self.reads_final = head.reads_final
        self.cache = None
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, features) to feed
        self.last_fed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.table: DraftTable | None = None  # every node the last draft() drafted (grow_tree)

    def _features(self, states: dict) -> torch.Tensor:
        return self.head.input_features(states)

    def start(self, prompt_ids: torch.Tensor, states: dict, root: int) -> None:
        self.cache = self.head.new_cache()
        ids = torch.cat([prompt_ids[:, 1:], prompt_ids.new_tensor([[root]])], dim=1)
        self.pending = (ids, self._features(states))

    def advance(self, states: dict, tokens: Sequence[int], bonus: int) -> None:
        device = self.cache_device
        ids = torch.tensor([list(tokens[1:]) + [bonus]], dtype=torch.long, device=device)
        feats = self._features(states)
        if self.pending is not None:  # a step drafted without this head (HybridDrafter): feed both
            ids, feats = torch.cat([self.pending[0], ids], dim=1), torch.cat([self.pending[1], feats], dim=1)
        self.pending = (ids, feats)

    @property
    def cache_device(self) -> torch.device:
        return self.head.device

    def rewind(self, n: int) -> None:
        """Forget the last n fed entries and queue them again (to time or repeat a drafting step),
        before what a step drafted without this head (HybridDrafter) left queued since."""
        ids, feats = self.last_fed
        n = min(n, ids.shape[1])
        self.cache.crop(self.cache.length - n)
        ids, feats = ids[:, -n:], feats[:, -n:]
        if self.pending is not None:
            ids, feats = torch.cat([ids, self.pending[0]], dim=1), torch.cat([feats, self.pending[1]], dim=1)
        self.pending = (ids, feats)

    def _catch_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the accepted tokens; returns the root's (hidden_out [Hd], draft log-probs [Vd])."""
        if self.pending is None:
            raise RuntimeError("draft() called twice without advance() or rewind()")
        ids, feats = self.pending
        self.pending = None
        self.last_fed = (ids, feats)
        start = self.cache.length
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        hidden, logits = self.head.draft_step(ids, feats, pos, self.cache)
        return hidden[0, -1], torch.log_softmax(logits[0, -1].float(), dim=-1)

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        root_hidden, root_logp = self._catch_up()
        stable = self.cache.length  # == prefix_len: entries for positions 0..prefix_len-1
        device = root_hidden.device
        hidden = {0: root_hidden}  # node id -> its draft output (its children's input feature)
        slot: dict[int, int] = {}  # node id -> its slot in the draft cache

        def child_logp(ids: list[int], table: DraftTable) -> torch.Tensor:
            if ids == [0]:
                return root_logp[None]
            new_ids = [i for i in ids if i != 0]
            n, past = len(new_ids), self.cache.length
            # the drafted slots each new node sees (its ancestors' and its own), built in Python and
            # sent as one tensor: a tensor write per slot costs more than the draft layer's attention
            seen = []
            for r, i in enumerate(new_ids):
                row = [False] * (past - stable + n)
                row[past - stable + r] = True
                a = table.parents[i]
                while a > 0:
                    row[slot[a] - stable] = True
                    a = table.parents[a]
                seen.append(row)
            if n == 1 and all(seen[0]):
                mask = None  # one query that sees every slot: the layer's unmasked one-query path
            else:
                drafted = torch.tensor(seen, dtype=torch.bool, device=device)
                mask = torch.cat([drafted.new_ones(n, stable), drafted], dim=1)[None, None]
            tok = torch.tensor([[table.tokens[i] for i in new_ids]], device=device)
            feats = torch.stack([hidden[table.parents[i]] for i in new_ids])[None]
            pos = torch.tensor([[stable - 1 + table.depths[i] for i in new_ids]], device=device)
            out, logits = self.head.draft_step(tok, feats, pos, self.cache, attention_mask=mask)
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            for r, i in enumerate(new_ids):
                hidden[i] = out[0, r]
                slot[i] = past + r
            if new_ids == ids:
                return logp
            rows = {i: logp[r] for r, i in enumerate(new_ids)}
            rows[0] = root_logp
            return torch.stack([rows[i] for i in ids])

        try:
            self.table = DraftTable()
            return grow_tree(root, child_logp, self.head.draft_to_target, self.policy, max_depth, self.table)
        finally:
            self.cache.crop(stable)


class ParallelDecoderDrafter(EagleDrafter):
    """P-EAGLE and DFlash: one draft forward feeds the accepted tokens and fills every depth of the
    tree at once (the later depths from the mask token), so the tree is grown from per-depth top-k as
    Medusa's is. The draft cache keeps the accepted entries only (DFlash: their context keys/values)."""

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The accepted rows to feed with this draft (ids, features), kept for rewind."""
        if self.pending is None:
            raise RuntimeError("draft() called twice without advance() or rewind()")
        ids, feats = self.pending
        self.pending = None
        self.last_fed = (ids, feats)
        return ids, feats

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        ids, feats = self.take_pending()
        depth = min(max_depth, policy_depth(self.policy))
        logp = torch.log_softmax(self.head.parallel_logits(ids, feats, self.cache, depth).float(), dim=-1)

        def child_logp(nodes: list[int], table: DraftTable) -> torch.Tensor:
            return logp[torch.tensor([table.depths[i] for i in nodes], device=logp.device)]

        self.table = DraftTable()
        return grow_tree(root, child_logp, self.head.draft_to_target, self.policy, max_depth, self.table)


class MarkovBlockDrafter(ParallelDecoderDrafter):
    """DSpark: one draft forward feeds the accepted rows and runs the block (heads/dspark.py); a
    node's children at depth d + 1 then come from that depth's slot with the Markov bias of the
    node's own token (the root's, the bonus token's), so a path's drafts depend on each other as a
    chain's do, each level's nodes biased in one call. The block stops at the first depth whose
    predicted cumulative acceptance (the product of the slots' predicted acceptance rates) along its
    top-1 chain is below head.confidence_threshold: the tree is cut there (at depth 0 the root
    alone is verified).

    DFlash2 drafts through the same block protocol (heads/dflash2.py SelectorBlock): a node's
    children are its depth's slot's top-k LM-head candidates in the selector's order after the
    node's token, the others at -inf; its blocks are never cut."""

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        ids, feats = self.take_pending()
        block = self.head.draft_block(ids, feats, self.cache, min(max_depth, policy_depth(self.policy)))
        max_depth = min(max_depth, block.stop_depth(root))

        def child_logp(nodes: list[int], table: DraftTable) -> torch.Tensor:
            logits = block.logits([table.depths[i] + 1 for i in nodes], [table.tokens[i] for i in nodes])
            return torch.log_softmax(logits.float(), dim=-1)

        self.table = DraftTable()
        return grow_tree(root, child_logp, self.head.draft_to_target, self.policy, max_depth, self.table)


class EarlyExitDrafter:
    """Early exit (Kangaroo): each drafted node runs the target's own first L layers on the
    target's KV cache (decode/target_layers.py), then the head's adapter on its own cache, then the
    target's LM head.

    The generation loop binds the target's cache (bind_target_cache) before start; at draft time it
    holds exactly the committed prefix (P tokens). The root (position P) and each level of the tree
    (position P + depth, siblings sharing it) are appended to the first L layers' entries and to the
    adapter's, each node seeing the prefix, its ancestors and itself; before the tree is returned
    both are cropped back to P, so verification sees only the committed prefix. After verification
    the adapter is fed the accepted tokens' layer-L states, which the verification forward captured
    (layer_ids), at the next draft (so that `rewind` can queue them again).

    A path stops where the head's path probability falls below the policy's min_path_prob (grow_tree):
    Kangaroo's early-exit threshold, which tree=auto calibrates.
    """

    def __init__(self, head, policy: TreePolicy):
        self.head = head
        self.policy = policy
        self.layer_ids = head.target_layer_ids()  # [L]: the stream leaving the first L layers
        self.reads_final = False
        check_layer_family(head.frozen_target)
        self.layers = list(range(head.exit_layer))  # the target's decoder layers each node runs
        self.target_cache = None  # the target's own KV cache (bind_target_cache)
        self.cache = None  # the adapter's: one entry per committed position (its layer-L state)
        self.pending: torch.Tensor | None = None  # layer-L states of positions not fed yet [1, n, H]
        self.last_fed: torch.Tensor | None = None
        self.table: DraftTable | None = None  # every node the last draft() drafted (grow_tree)
        self.exit_states: dict[int, torch.Tensor] = {}  # node -> its layer-L state in the last draft

    def bind_target_cache(self, cache) -> None:
        self.target_cache = cache

    def start(self, prompt_ids: torch.Tensor, states: dict, root: int) -> None:
        self.cache = self.head.new_cache()
        self.pending = states[self.layer_ids[0]]

    def advance(self, states: dict, tokens: Sequence[int], bonus: int) -> None:
        fed = states[self.layer_ids[0]]  # the accepted path's, root first
        # a step drafted without this head (HybridDrafter) left its positions unfed: feed both
        self.pending = fed if self.pending is None else torch.cat([self.pending, fed], dim=1)

    def rewind(self, n: int) -> None:
        """Queue the last n fed positions again (the adapter's cache forgets them), before what a
        step drafted without this head (HybridDrafter) left queued since."""
        n = min(n, self.last_fed.shape[1])
        self.cache.crop(self.cache.length - n)
        again = self.last_fed[:, -n:]
        self.pending = again if self.pending is None else torch.cat([again, self.pending], dim=1)

    def _catch_up(self) -> None:
        """Feed the queued committed positions to the adapter (no logits: the prefix is drafted)."""
        if self.pending is None:
            return
        fed, self.pending = self.pending, None
        start = self.cache.length
        pos = torch.arange(start, start + fed.shape[1], device=fed.device)[None]
        self.head.adapt(fed, pos, self.cache)
        self.last_fed = fed

    def node_positions(self, prefix_len: int, depths: list[int]) -> list[int]:
        """RoPE positions of drafted nodes: the root sits at prefix_len, a node at depth d d further."""
        return [prefix_len + d for d in depths]

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        if self.target_cache is None:
            raise RuntimeError("an early-exit drafter drafts on the target's cache: call bind_target_cache first")
        self._catch_up()
        held = sorted({int(self.target_cache.layers[i].get_seq_length()) for i in self.layers})
        if self.cache.length != prefix_len or held != [prefix_len]:
            raise RuntimeError(
                f"early-exit drafter out of step: {prefix_len} committed tokens, the adapter holds "
                f"{self.cache.length}, the target's first layers {held}"
            )
        self.exit_states = {}

        def read(exit_states: torch.Tensor, positions: torch.Tensor, visible, ids: list[int]) -> torch.Tensor:
            mask = None if visible is None else visible.to(exit_states.device)[None, None]
            logits = self.head.draft_logits(self.head.adapt(exit_states, positions[None], self.cache, mask))
            for r, i in enumerate(ids):
                self.exit_states[i] = exit_states[0, r]
            return logits[0]

        self.table = DraftTable()
        try:
            return grow_on_target_layers(
                self.head.frozen_target, self.layers, self.target_cache, root, prefix_len, max_depth,
                self.policy, self.table, read, self.node_positions, self.head.draft_to_target,
            )  # fmt: skip
        finally:
            self.cache.crop(prefix_len)


def grow_on_target_layers(
    target,
    layers: Sequence[int],
    cache,
    root: int,
    prefix_len: int,
    max_depth: int,
    policy: TreePolicy,
    table: DraftTable,
    read: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int]], torch.Tensor],
    node_positions: Callable[[int, list[int]], list[int]],
    to_target: ToTarget = lambda ids: ids,
) -> tuple[list[int], TreeLayout]:
    """grow_tree whose levels run some of the target's own decoder `layers` on its KV cache
    (target_layers.run_layers), as the early-exit and layer-skip drafters do.

    Each level's nodes (the parents whose children are asked for, each run once) go through the
    layers in one call at their RoPE positions (node_positions(prefix_len, depths)), each seeing the
    committed prefix, its ancestors' slots and its own; read(states, positions, visible, ids) turns
    the stream leaving the last layer ([1, n, H]) into log-probability-ready logits [n, V] (visible:
    the bool [n, past + n] mask, None when the lone query sees every slot), over a draft vocabulary
    that to_target maps to the target's ids. Whatever happens, the
    layers' drafted entries are cropped back to the committed prefix before it returns, so that the
    target verifies on its committed sequence alone."""
    device = target.device
    slot: dict[int, int] = {}  # node -> its slot in the cache (prefix_len + its order of drafting)

    def child_logp(ids: list[int], table: DraftTable) -> torch.Tensor:
        n, past = len(ids), len(slot) + prefix_len
        seen = []
        for r, i in enumerate(ids):
            row = [False] * (past - prefix_len + n)
            row[past - prefix_len + r] = True
            a = table.parents[i]
            while a >= 0:
                row[slot[a] - prefix_len] = True
                a = table.parents[a]
            seen.append(row)
        visible = None
        if not (n == 1 and all(seen[0])):  # else one query that sees every slot: no mask
            drafted = torch.tensor(seen, dtype=torch.bool)
            visible = torch.cat([drafted.new_ones(n, prefix_len), drafted], dim=1)
        tokens = torch.tensor([[table.tokens[i] for i in ids]], device=device)
        positions = torch.tensor(node_positions(prefix_len, [table.depths[i] for i in ids]), device=device)
        states = run_layers(target, layers, target.embed_tokens(tokens), positions, cache, visible)
        logits = read(states, positions, visible, ids)
        for r, i in enumerate(ids):
            slot[i] = past + r
        return torch.log_softmax(logits.float(), dim=-1)

    try:
        return grow_tree(root, child_logp, to_target, policy, max_depth, table)
    finally:
        crop_layers(cache, layers, prefix_len)


def path_tokens(table: DraftTable, node: int) -> list[int]:
    """The tokens from the root down to `node` (both included)."""
    path = [table.tokens[node]]
    while table.parents[node] >= 0:
        node = table.parents[node]
        path.append(table.tokens[node])
    return path[::-1]


class SequentialDrafter:
    """Hydra: the children of a node at depth d come from head d, given the base state at the last
    accepted token and the embeddings of the node's path (root included); the nodes of one level
    go through their head in one call.

    Without a prefix layer the base state is the target's final state there, as for Medusa. With
    one, the layer's KV cache holds one entry per committed position; accepted positions are fed
    lazily at the next draft (so that `rewind` can queue them again).
    """

    def __init__(self, head, policy: TreePolicy):
        self.head = head
        self.policy = policy
        self.layer_ids: list[int] = []
        self.reads_final = True
        self.cache = None
        self.pending: torch.Tensor | None = None  # final states of positions not fed yet [1, n, H]
        self.last_fed: torch.Tensor | None = None
        self.base: torch.Tensor | None = None  # [H] the heads' base state at the last accepted token
        self.table: DraftTable | None = None  # every node the last draft() drafted (grow_tree)

    def start(self, prompt_ids: torch.Tensor, states: dict, root: int) -> None:
        self.cache = self.head.new_prefix_cache()
        self.pending = states["final"]

    def advance(self, states: dict, tokens: Sequence[int], bonus: int) -> None:
        final = states["final"]
        # a step drafted without this head (HybridDrafter) left its positions unfed: feed both
        self.pending = final if self.pending is None else torch.cat([self.pending, final], dim=1)

    def rewind(self, n: int) -> None:
        """Queue the last n fed positions again (the prefix layer's cache forgets them), before what
        a step drafted without this head (HybridDrafter) left queued since."""
        n = min(n, self.last_fed.shape[1])
        if self.cache is not None:
            self.cache.crop(self.cache.length - n)
        again = self.last_fed[:, -n:]
        self.pending = again if self.pending is None else torch.cat([again, self.pending], dim=1)

    def _catch_up(self) -> torch.Tensor:
        if self.pending is not None:
            fed, self.pending = self.pending, None
            self.base = self.head.base_states(fed, self.cache)[0, -1]
            self.last_fed = fed
        return self.base

    def child_logp(self, base: torch.Tensor, ids: list[int], table: DraftTable) -> torch.Tensor:
        """[len(ids), V] log-probs of each node's children: one head call per depth among ids."""
        rows: dict[int, torch.Tensor] = {}
        for d in sorted({table.depths[i] for i in ids}):
            if d >= self.head.spec.num_heads:
                raise RuntimeError(f"a {self.head.title} head has no head for depth {d + 1}")
            level = [i for i in ids if table.depths[i] == d]
            paths = torch.tensor([path_tokens(table, i) for i in level], device=base.device)
            logits = self.head.head_logits(d, base.expand(len(level), -1), paths)
            logp = torch.log_softmax(logits, dim=-1)
            rows.update({i: logp[r] for r, i in enumerate(level)})
        return torch.stack([rows[i] for i in ids])

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        base = self._catch_up()
        self.table = DraftTable()
        return grow_tree(
            root,
            lambda ids, table: self.child_logp(base, ids, table),
            lambda ids: ids,
            self.policy,
            max_depth,
            self.table,
        )


# the drafter for each head's draft_kind
DRAFTERS = {
    "parallel": MedusaDrafter,
    "autoregressive": EagleDrafter,
    "sequential": SequentialDrafter,
    "parallel_decoder": ParallelDecoderDrafter,
    "markov_block": MarkovBlockDrafter,
    "early_exit": EarlyExitDrafter,
}


def make_drafter(head, policy: TreePolicy):
    if head.draft_kind not in DRAFTERS:
        raise SpecHeadsError(f"no drafter for head family {head.family!r}")
    check_depth(head, policy)  # a Medusa head drafts one depth per head
    return DRAFTERS[head.draft_kind](head, policy)


def text_continuations(
    seq: Sequence[int], max_ngram: int, budget: int, max_len: int, min_ngram: int = 1
) -> list[list[int]]:
    """What followed the text's last n-gram where it occurred before (prompt lookup, as a trie).

    n runs from max_ngram down to min_ngram (longer matches first); for each n the most recent earlier
    occurrence comes first. Each continuation is cut at max_len tokens, and continuations are
    taken while their trie (shared prefixes counted once) has at most `budget` nodes, so the
    first one can take the whole budget, as a single prompt-lookup chain would.
    """
    seq = list(seq)
    total = len(seq)
    chains: list[list[int]] = []
    if budget < 1 or max_len < 1:
        return chains
    trie: set[tuple[int, ...]] = set()
    for n in range(min(max_ngram, total - 1), max(min_ngram, 1) - 1, -1):
        tail = seq[-n:]
        last = tail[-1]
        for start in range(total - n - 1, -1, -1):  # an occurrence with at least one token after it
            if seq[start + n - 1] != last or seq[start : start + n] != tail:
                continue
            kept: list[int] = []
            added = False
            for t in seq[start + n : start + n + max_len]:
                path = (*kept, t)
                if path not in trie:
                    if len(trie) == budget:
                        break
                    trie.add(path)
                    added = True
                kept.append(t)
            if added:  # a continuation already in the trie adds nothing
                chains.append(kept)
            if len(trie) == budget:
                return chains
    return chains


def chain_nodes(chains: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """The nodes of a token trie given as root-to-leaf chains (text_continuations'), each once, in
    the order the chains add them (every node after its parent)."""
    order: dict[tuple[int, ...], None] = {}
    for chain in chains:
        for m in range(1, len(chain) + 1):
            order.setdefault(tuple(int(t) for t in chain[:m]))
    return tuple(order)


class HybridDrafter:
    """One tree from two drafters: a head's tree (any family, or none) and the continuations of
    the text's own repeats (prompt and answer so far; with the suffix source, earlier answers too),
    merged by tree.merge_chains and verified in one target forward. Without a head it is prompt
    lookup decoding through this package's loop.

    Which of them a step drafts is the policy's: a fixed split (ngram_nodes text nodes merged, the
    text alone after a repeat), or the adaptive per-step choice of decode/hybrid_rule.py.

    Every node is a deterministic function of the text and of what was accepted before (the head
    drafts top-k), so the verify rules treat it as a one-hot proposal; `sources` says which drafter
    proposed each node of the last tree, for the benchmark's share of accepted tokens per source.
    """

    def __init__(self, inner, policy: HybridPolicy):
        self.inner = inner  # the head's drafter, or None
        self.head = getattr(inner, "head", None)
        self.policy = policy
        self.layer_ids = list(inner.layer_ids) if inner is not None else []
        self.reads_final = inner.reads_final if inner is not None else False
        # prompt + committed tokens, the root included (and, for the suffix source, earlier answers)
        self.index = SuffixIndex(policy.suffix_match if policy.source == "suffix" else 1, policy.suffix_history)
        self.rule = AdaptiveRule(policy.rule, inner is not None) if policy.rule is not None else None
        self.sources: tuple[int, ...] = (0,)
        self.last: tuple[list[int], TreeLayout, Choice, float] | None = None  # the last tree, for observe
        self.choices: dict[Choice, int] = {}  # how often each choice was made (the benchmark reports it)

    @property
    def text(self) -> list[int]:
        return self.index.text

    def bind_target_cache(self, cache) -> None:
        """The target's cache, for a head's drafter that runs the target's own layers (early exit)."""
        bind = getattr(self.inner, "bind_target_cache", None)
        if bind is not None:
            bind(cache)

    def start(self, prompt_ids: torch.Tensor, states: dict, root: int) -> None:
        self.index.start_request(prompt_ids[0].tolist())
        self.index.extend([int(root)])  # the answer's first token
        self.last = None
        if self.rule is not None:
            self.rule.start()
        if self.inner is not None:
            self.inner.start(prompt_ids, states, root)

    def forget_history(self) -> None:
        """Earlier answers stop counting (a benchmark's warm-up must not seed what it times)."""
        self.index.forget_history()

    def advance(self, states: dict, tokens: Sequence[int], bonus: int) -> None:
        if self.rule is not None and self.last is not None:
            self._observe(tokens)
        self.index.extend([int(t) for t in tokens[1:]] + [int(bonus)])
        if self.inner is not None:
            self.inner.advance(states, tokens, bonus)

    def finish(self, tokens: Sequence[int]) -> None:
        """The request's last committed tokens (no advance follows them): the answer joins the history
        whole when the next request starts, as calibration's text walk counts it."""
        self.index.extend([int(t) for t in tokens])

    def _observe(self, accepted: Sequence[int]) -> None:
        """Tell the rule how much of the accepted path each drafted source proposed."""
        tokens, layout, choice, expected = self.last
        node, head, text = 0, 0, 0
        for t in accepted[1:]:
            node = next((c for c in layout.children[node] if tokens[c] == int(t)), None)
            if node is None:
                break
            head += bool(self.sources[node] & FROM_HEAD)
            text += bool(self.sources[node] & FROM_TEXT)
        self.rule.observe(choice, expected, head, text)

    def rewind(self, n: int) -> None:
        """The text is not changed by drafting: only the head has work to redo."""
        if self.inner is not None:
            self.inner.rewind(n)

    def _head_tree(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        if self.inner is None:
            return [root], TreeLayout((-1,))
        return self.inner.draft(root, prefix_len, max_depth)

    def text_draft(self, max_depth: int, budget: int, min_match: int = 1) -> TextDraft:
        """The text source's best `budget` nodes (at most max_depth deep) continuing a repeat of at
        least min_match tokens (none: an empty draft): what draft() hangs below the root, a budget of
        g drafting the first g of them. Calibration steps this drafter along its answers and reads
        them here (bench/hybrid_fit.walk_text). The n-gram source scores no node (scores empty,
        match 0): its nodes are in the order its chains add them."""
        p = self.policy
        if p.source == "suffix":
            text = self.index.draft(max_depth, budget)
            return text if text.match >= min_match else TextDraft()
        chains = text_continuations(self.text, p.ngram_max, budget, max_depth, min_ngram=min_match)
        return TextDraft(chain_nodes(chains))

    def _merged(self, tokens, layout, chains) -> tuple[list[int], TreeLayout]:
        tokens, layout, self.sources = merge_chains(tokens, layout, chains)
        return tokens, layout

    def draft(self, root: int, prefix_len: int, max_depth: int) -> tuple[list[int], TreeLayout]:
        p = self.policy
        if self.rule is not None:
            text = self.index.draft(max_depth, max(p.rule.text_budgets))
            choice = self.rule.choose(text)
            self.choices[choice] = self.choices.get(choice, 0) + 1
            base = self._head_tree(root, prefix_len, max_depth) if choice.head else ([root], TreeLayout((-1,)))
            tokens, layout = self._merged(*base, text.chains(choice.text_nodes))
            self.last = (tokens, layout, choice, p.rule.text_expected(text, choice.text_nodes))
            return tokens, layout
        if p.source == "suffix":
            text = self.text_draft(max_depth, max(p.text_alone, p.ngram_nodes))
            if p.text_alone and self.inner is not None and text.match >= p.alone_ngram:
                return self._merged([root], TreeLayout((-1,)), text.chains(p.text_alone))
            return self._merged(*self._head_tree(root, prefix_len, max_depth), text.chains(p.ngram_nodes))
        if p.text_alone and self.inner is not None:
            alone = text_continuations(self.text, p.ngram_max, p.text_alone, max_depth, min_ngram=p.alone_ngram)
            if alone:  # a long repeat: its continuations alone, verified as cheaply as prompt lookup's
                return self._merged([root], TreeLayout((-1,)), alone)
        chains = text_continuations(self.text, p.ngram_max, p.ngram_nodes, max_depth)
        return self._merged(*self._head_tree(root, prefix_len, max_depth), chains)


def make_hybrid_drafter(head, policy: HybridPolicy) -> HybridDrafter:
    """The hybrid drafter of `policy` over `head` (None: the text's repeats alone)."""
    if head is None or policy.head is None:
        return HybridDrafter(None, policy)
    return HybridDrafter(make_drafter(head, policy.head), policy)
