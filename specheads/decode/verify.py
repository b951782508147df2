"""Acceptance rules: which drafted path of a verified tree to keep, and the target's next token.

Inputs are one tree (node tokens + layout, node 0 = root) and the target's outputs at every
node: row i is the target's next-token distribution given the prefix, the root and node i's
ancestors (the tree attention mask makes it so). All functions are pure apart from the random
generator they are handed.

- greedy_accept: the longest path that matches the target's argmax, plus the argmax after it.
  Output is exactly the target's greedy decoding.
- speculative_accept: recursive rejection sampling over siblings (SpecInfer / EAGLE). Lossless:
  the emitted tokens are distributed exactly as sampling from the target one token at a time,
  also when a head's sampled children and the text's one-hot continuations are siblings.
- typical_accept: Medusa's typical acceptance. LOSSY by design; opt-in only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sampling import sampling_probs
from .tree import FROM_TEXT, TreeLayout


@dataclass(frozen=True)
class Acceptance:
    path: tuple[int, ...]  # accepted node ids from the root (always path[0] == 0)
    bonus: int  # the target's own next token after the last accepted node

    @property
    def num_accepted(self) -> int:
        """Drafted tokens accepted (the root is not a draft)."""
        return len(self.path) - 1


def greedy_accept(tokens: Sequence[int], layout: TreeLayout, target_logits: torch.Tensor) -> Acceptance:
    """Walk down from the root while some child equals the target's argmax at its parent."""
    best = target_logits.argmax(dim=-1).tolist()
    node, path = 0, [0]
    while True:
        want = best[node]
        nxt = next((c for c in layout.children[node] if tokens[c] == want), None)
        if nxt is None:
            return Acceptance(tuple(path), int(want))
        node = nxt
        path.append(node)


def speculative_accept(
    tokens: Sequence[int],
    layout: TreeLayout,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    one_hot: Sequence[bool] | None = None,
) -> Acceptance:
    """Multi-round rejection sampling down the tree; the output follows target_probs exactly.

    target_probs: [N, V], row i = target distribution after node i (already through
    `sampling_probs`). draft_probs: [N, V] or None; row i = the distribution node i's token was
    drawn from, given its parent and its earlier siblings (for drafts sampled without replacement
    that is the parent's draft distribution with the earlier siblings removed and renormalised).
    None means every draft is deterministic (top-k), i.e. a one-hot proposal. one_hot: per node,
    True where the proposal is one-hot at the node's token whatever draft_probs holds there: the
    text's continuations of a hybrid tree (tree.merge_chains) beside a head's sampled children;
    one_hot_nodes(sources) gives it (a node both drafters proposed is a head draw, not one-hot).

    At a node with target distribution p, each child x (proposal q) in turn is accepted with
    probability min(1, p(x) / q(x)); on rejection p becomes norm(max(p - q, 0)). If every child
    is rejected, the bonus token is drawn from what is left of p. Each round is a standard
    speculative-sampling step whose fallback is the next round, so by induction the token that
    leaves the node is distributed as the original p, whatever the proposals were.

    Why the rounds stay exact with mixed siblings. Write p_k for what is left of p when child k
    is tried, and H_k for everything drawn before it (the earlier siblings' tokens and uniforms).
    The step lemma: if, given H_k, x ~ q_k, then "accept x with min(1, p_k(x)/q_k(x)), else take a
    sample of r = norm(max(p_k - q_k, 0))" outputs y with probability
    min(p_k(y), q_k(y)) + (1 - sum_z min(p_k(z), q_k(z))) r(y) = p_k(y), because
    sum_z max(p_k(z) - q_k(z), 0) = 1 - sum_z min(p_k(z), q_k(z)). So each node needs q_k = the law
    of its token given H_k, and then by induction from the last round (the bonus draw from what is
    left) the token leaving the node follows p_1 = p. A head child sampled without replacement
    has that law in draft_probs: its draw depends on its earlier head siblings only. A text child
    (a continuation of an earlier occurrence of the last n-gram) is a fixed function of the
    committed text and of H_k, so given H_k its law is the point mass at its token: acceptance
    with probability p_k(x) and residual p_k without x (max(p_k - onehot_x, 0), renormalised). That
    holds for the decision to add it at all: merge_chains puts the head's children first and
    drops a text token equal to one of them, a function of H_k as well (and such a token was
    already rejected, so p_k(x) = 0 and skipping its round changes nothing). In the other order a
    head child equal to an earlier text sibling would be dropped depending on its own draw, and
    its law would no longer be draft_probs. Giving a text child the head's q instead (accept with
    p(x)/q(x), residual p - q) is not exact: its token was not drawn from q.
    """
    node, path = 0, [0]
    uniforms = torch.rand(layout.size, generator=generator, device=target_probs.device).tolist()
    while True:
        p = target_probs[node].float()
        moved = False
        for child in layout.children[node]:
            x = tokens[child]
            point = draft_probs is None or (one_hot is not None and one_hot[child])
            if point:
                ratio = float(p[x])  # q is one-hot at x
            else:
                q = draft_probs[child].float()
                qx = float(q[x])
                ratio = 1.0 if qx <= 0 else min(1.0, float(p[x]) / qx)
            if uniforms[child] < ratio:
                node, moved = child, True
                path.append(child)
                break
            if point:
                residual = p.clone()
                residual[x] = 0
            else:
                residual = torch.clamp(p - q, min=0)
            mass = float(residual.sum())
            if mass > 0:  # mass 0 only if p == q, where the child is accepted with probability 1
                p = residual / mass
        if not moved:
            bonus = torch.multinomial(p, 1, generator=generator)
            return Acceptance(tuple(path), int(bonus))


def one_hot_nodes(sources: Sequence[int]) -> list[bool]:
    """speculative_accept's `one_hot` for a hybrid tree from its sources (tree.merge_chains): the
    text's own nodes only. A node both drafters proposed is a head child the text's chain passed
    through, so its token was the head's draw: given as one-hot, it would be accepted with p(x)
    instead of min(1, p(x)/q(x)) and leave the wrong residual, and sampling would not be exact."""
    return [s == FROM_TEXT for s in sources]


def typical_accept(
    tokens: Sequence[int],
    layout: TreeLayout,
    target_logits: torch.Tensor,
    temperature: float,
    epsilon: float = 0.09,
    alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance (LOSSY): accept x after node i when p_i(x) > min(eps, alpha*exp(-H(p_i))).

    The longest accepted root-to-leaf prefix wins (ties: larger summed log p); the bonus token is
    sampled from the target at the last accepted node. Output does NOT follow the target's
    distribution; use it only when asked for.
    """
    probs = torch.softmax(target_logits.float() / max(temperature, 1e-5), dim=-1)
    entropy = -(probs * torch.log(probs + 1e-5)).sum(dim=-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy))
    best_path, best_key = [0], (0, 0.0)
    for row in layout.retrieve.tolist():
        nodes = [n for n in row if n >= 0]
        kept, logp = [0], 0.0
        for parent, child in zip(nodes, nodes[1:]):
            px = float(probs[parent, tokens[child]])
            if px <= float(threshold[parent]):
                break
            kept.append(child)
            logp += math.log(px)
        key = (len(kept), logp)
        if key > best_key:
            best_path, best_key = kept, key
    last = best_path[-1]
    if temperature <= 0:
        return Acceptance(tuple(best_path), int(target_logits[last].argmax()))
    bonus = torch.multinomial(sampling_probs(target_logits[last], temperature), 1, generator=generator)
    return Acceptance(tuple(best_path), int(bonus))
