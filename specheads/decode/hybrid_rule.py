"""The hybrid drafter's per-step choice: the head's tree, the text's continuations, both, or neither.

Before a step is drafted the drafter knows what the text source proposes (decode/suffix.py: each
node's estimated probability, so the expected accepted length of its best g nodes) and how each
source has done so far in this request. The rule prices every option from the calibrated costs (a
verification of n query tokens, the head's drafting) and takes the one with the most expected
tokens per unit of cost:

  plain           1 token,                           verify(1)
  text alone, g   1 + t(g),                          verify(1 + g) + lookup
  head + text, g  1 + max(h, t(g)) + c min(h, t(g)), verify(1 + H + g - s min(h, t(g))) + draft + lookup

where h is the head's expected accepted drafts per step, t(g) = r * R(m, g) * (sum of the g best
text scores) with R the calibrated ratio of accepted to expected text tokens where the matched
suffix is m tokens long, r this request's own correction of it, H the head tree's nodes, c (fitted
at calibration) how much a merged tree gains over the better of its two parts, and s (fitted too)
the text nodes per token of min(h, t(g)) that fall on nodes of the head's tree: tree.merge_chains
verifies a node both drafted once, and where both are right they drafted the same tokens. h and r
are running estimates per request started from their calibrated values (RunningEstimate), so a
request that copies its prompt soon trusts the text and one that does not soon stops paying for it.
Costs only matter relative to each other, so the calibrated milliseconds serve on any machine the
ratios hold on.

The choice is a function of the text and of the request's accepted counts so far, so every node is
still a deterministic proposal given the past: greedy and speculative acceptance stay exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .suffix import TextDraft

TEXT_BUDGETS = (0, 1, 2, 4, 8, 12, 16)


@dataclass(frozen=True)
class Choice:
    """What one step drafts: the head's tree or not, and how many text nodes."""

    head: bool
    text_nodes: int


@dataclass(frozen=True)
class RuleParams:
    """The calibrated numbers the rule starts each request from (the calibration record's
    hybrid.rule)."""

    verify_ms: tuple[float, ...]  # verify_ms[n - 1]: a target forward of n query tokens (the root included)
    draft_ms: float  # one step of the head's drafting of its tree
    head_nodes: float  # nodes of the head's tree (root excluded), on average where it is gated
    head_accept: float  # accepted drafts per step of the head's tree alone
    text_ratio: float = 1.0  # accepted text tokens per expected one (TextDraft.expected), where no table is
    # text_ratios[m - 1][j]: that ratio where the matched suffix is m tokens long (the last row: m or
    # more) and the text drafts text_budgets[j] nodes (or fewer): long matches and few nodes are
    # right more often than their scores say, one-token matches and long chains less
    text_ratios: tuple[tuple[float, ...], ...] = ()
    overlap: float = 0.0  # c above: a merged tree's gain over the better part, per token of the lesser
    # s above: text nodes verified as the head's, per token of the lesser expectation (0: every
    # text node priced as a node of its own, as a calibration recorded before this term)
    shared: float = 0.0
    lookup_ms: float = 0.0  # one step of the text source
    prior_steps: float = 4.0  # how many steps' worth the calibrated values weigh against a request's own
    text_budgets: tuple[int, ...] = TEXT_BUDGETS

    def __post_init__(self):
        if not self.verify_ms or any(v <= 0 for v in self.verify_ms):
            raise ValueError("verify_ms needs a positive time for 1, 2, ... query tokens")

    def verify(self, n: float) -> float:
        """A forward of n query tokens: the measured sizes, linear between and beyond them."""
        v = self.verify_ms
        if n <= 1:
            return v[0]
        if n <= len(v):
            lo = int(n)
            frac = n - lo
            return v[lo - 1] + frac * (v[min(lo, len(v) - 1)] - v[lo - 1])
        slope = (v[-1] - v[0]) / max(len(v) - 1, 1)
        return v[-1] + slope * (n - len(v))

    def text_expected(self, text: TextDraft, nodes: int) -> float:
        """The text's best `nodes` nodes: their expected accepted length, calibrated."""
        if not nodes or not text.paths:
            return 0.0
        ratio = self.text_ratio
        if self.text_ratios:
            row = self.text_ratios[min(max(text.match, 1), len(self.text_ratios)) - 1]
            col = next((j for j, b in enumerate(self.text_budgets) if b >= nodes), len(self.text_budgets) - 1)
            ratio = row[col]
        return ratio * text.expected(nodes)

    def to_record(self) -> dict:
        record = asdict(self)
        record["verify_ms"] = [round(x, 4) for x in self.verify_ms]
        record["text_budgets"] = list(self.text_budgets)
        record["text_ratios"] = [[round(x, 4) for x in row] for row in self.text_ratios]
        return record

    @classmethod
    def from_record(cls, record: dict) -> RuleParams:
        known = {k: v for k, v in record.items() if k in cls.__dataclass_fields__}
        known["verify_ms"] = tuple(float(x) for x in known["verify_ms"])
        if "text_budgets" in known:
            known["text_budgets"] = tuple(int(x) for x in known["text_budgets"])
        if "text_ratios" in known:
            known["text_ratios"] = tuple(tuple(float(x) for x in row) for row in known["text_ratios"])
        return cls(**known)


@dataclass
class RunningEstimate:
    """A ratio of running sums started from a prior: (w * prior + sum observed) / (w + sum weight).

    With weight 1 per observation it is the request's mean shrunk toward the prior; with the
    expected value as the weight it is the ratio of what happened to what was expected."""

    prior: float
    prior_weight: float
    observed: float = 0.0
    weight: float = 0.0

    def update(self, observed: float, weight: float = 1.0) -> None:
        self.observed += observed
        self.weight += weight

    @property
    def value(self) -> float:
        return (self.prior_weight * self.prior + self.observed) / (self.prior_weight + self.weight)


@dataclass
class AdaptiveRule:
    """The per-step choice of the module's docstring, with the request's running estimates."""

    params: RuleParams
    has_head: bool
    head: RunningEstimate = field(init=False)
    text: RunningEstimate = field(init=False)

    def __post_init__(self):
        self.start()

    def start(self) -> None:
        """A new request: the estimates go back to their calibrated values."""
        p = self.params
        self.head = RunningEstimate(p.head_accept, p.prior_steps)
        # a scale on the calibrated expectation (1: as calibrated), worth prior_steps expected tokens
        self.text = RunningEstimate(1.0, p.prior_steps)

    def options(self, text: TextDraft) -> list[tuple[Choice, float, float]]:
        """Every option with its expected tokens and cost (ms)."""
        p = self.params
        h, r = self.head.value, self.text.value
        out = [(Choice(False, 0), 1.0, p.verify(1))]
        budgets = sorted({min(g, len(text.paths)) for g in p.text_budgets})
        for g in budgets:
            t = r * p.text_expected(text, g)
            lookup = p.lookup_ms if g else 0.0
            if g:
                out.append((Choice(False, g), 1.0 + t, p.verify(1 + g) + lookup))
            if self.has_head:
                tokens = 1.0 + max(h, t) + p.overlap * min(h, t)
                nodes = 1 + p.head_nodes + g - min(p.shared * min(h, t), g)
                out.append((Choice(True, g), tokens, p.verify(nodes) + p.draft_ms + lookup))
        return out

    def choose(self, text: TextDraft) -> Choice:
        best = max(self.options(text), key=lambda o: o[1] / o[2])
        return best[0]

    def observe(self, choice: Choice, expected_text: float, head_accepted: int, text_accepted: int) -> None:
        """What the step's verification accepted of each source it drafted (a source's accepted
        length is the accepted path's nodes that source proposed, a prefix of the path);
        expected_text: params.text_expected of the nodes drafted."""
        if choice.head:
            self.head.update(head_accepted)
        if choice.text_nodes and expected_text > 0:
            self.text.update(text_accepted, expected_text)
