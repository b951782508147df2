"""The adaptive hybrid rule: its choice against the options priced plainly, its running estimates
against a recomputation from the whole history."""

import dataclasses
import random

import pytest
from conftest import fails_for_some_seed

from specheads.decode.hybrid_rule import AdaptiveRule, Choice, RuleParams, RunningEstimate
from specheads.decode.suffix import TextDraft


def random_params(rng):
    verify = [10.0]
    for _ in range(40):
        verify.append(verify[-1] + rng.uniform(0.0, 3.0))
    return RuleParams(
        verify_ms=tuple(verify),
        draft_ms=rng.uniform(0.5, 8.0),
        head_nodes=rng.uniform(1, 8),
        head_accept=rng.uniform(0.2, 2.0),
        text_ratio=rng.uniform(0.2, 1.2),
        overlap=rng.uniform(0.0, 0.5),
        shared=rng.uniform(0.0, 1.0),
        lookup_ms=rng.uniform(0.0, 0.3),
        prior_steps=rng.uniform(1, 8),
    )


def random_text(rng):
    n = rng.randint(0, 20)
    scores = sorted((rng.random() for _ in range(n)), reverse=True)
    return TextDraft(tuple((i,) for i in range(n)), tuple(scores), rng.randint(1, 8) if n else 0)


def history_estimates(params, steps):
    """(h, r) recomputed from every step at once: the head's prior plus its accepted drafts over the
    prior's weight plus the steps it drafted; the text's scale (prior 1: as calibrated) plus its
    accepted tokens over the prior's weight plus the tokens it was expected to get accepted, on the
    steps it drafted."""
    heads = [a for c, _, a, _ in steps if c.head]
    texts = [(e, a) for c, e, _, a in steps if c.text_nodes and e > 0]
    w = params.prior_steps
    h = (w * params.head_accept + sum(heads)) / (w + len(heads))
    r = (w * 1.0 + sum(a for _, a in texts)) / (w + sum(e for e, _ in texts))
    return h, r


def check_running_estimates(make_rule, seed):
    rng = random.Random(seed)
    params = random_params(rng)
    rule = make_rule(params, True)
    steps = []
    for _ in range(rng.randint(1, 30)):
        text = random_text(rng)
        choice = rule.choose(text)
        expected = params.text_expected(text, choice.text_nodes)
        head_acc, text_acc = rng.randint(0, 4), rng.randint(0, choice.text_nodes)
        rule.observe(choice, expected, head_acc, text_acc)
        steps.append((choice, expected, head_acc, text_acc))
        h, r = history_estimates(params, steps)
        assert rule.head.value == pytest.approx(h) and rule.text.value == pytest.approx(r)
    rule.start()  # a new request starts from the calibrated values again
    assert (rule.head.value, rule.text.value) == pytest.approx((params.head_accept, 1.0))


@pytest.mark.parametrize("seed", range(20))
def test_the_running_estimates_equal_a_recomputation_from_the_history(seed):
    check_running_estimates(AdaptiveRule, seed)


class MovingAverage(AdaptiveRule):
    """A wrong variant: the head's estimate is an exponential moving average, the prior soon lost."""

    def observe(self, choice, expected_text, head_accepted, text_accepted):
        super().observe(choice, expected_text, 0, text_accepted)
        if choice.head:
            self.head = RunningEstimate(0.5 * self.head.value + 0.5 * head_accepted, self.head.prior_weight)


class TextCountedEveryStep(AdaptiveRule):
    """A wrong variant: the text's ratio also learns from steps that drafted no text."""

    def observe(self, choice, expected_text, head_accepted, text_accepted):
        super().observe(choice, expected_text, head_accepted, text_accepted)
        if not choice.text_nodes:
            self.text.update(0.0, 1.0)


def test_the_estimate_check_fails_on_a_wrong_estimator():
    assert fails_for_some_seed(check_running_estimates, MovingAverage, range(20))
    assert fails_for_some_seed(check_running_estimates, TextCountedEveryStep, range(20))


def plain_choice(params, h, r, text, has_head):
    """The option with the most expected tokens per ms, each priced as the rule's docstring says."""

    def verify(n):  # the measured sizes, linear between and beyond
        v = params.verify_ms
        if n <= len(v):
            lo = int(n)
            return v[lo - 1] + (n - lo) * (v[min(lo, len(v) - 1)] - v[lo - 1])
        return v[-1] + (v[-1] - v[0]) / (len(v) - 1) * (n - len(v))

    best, best_rate = Choice(False, 0), 1.0 / verify(1)
    for g in sorted({min(b, len(text.paths)) for b in params.text_budgets}):
        t = r * params.text_ratio * sum(text.scores[:g])  # no table: one calibrated ratio
        look = params.lookup_ms if g else 0.0
        options = [(Choice(False, g), 1 + t, verify(1 + g) + look)] if g else []
        if has_head:
            merged = 1 + max(h, t) + params.overlap * min(h, t)
            once = min(params.shared * min(h, t), g)  # text nodes verified as the head's
            cost = verify(1 + params.head_nodes + g - once) + params.draft_ms + look
            options.append((Choice(True, g), merged, cost))
        for choice, tokens, cost in options:
            if tokens / cost > best_rate + 1e-12:
                best, best_rate = choice, tokens / cost
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_choice_is_the_best_priced_option(seed):
    rng = random.Random(seed)
    params = random_params(rng)
    has_head = rng.random() < 0.8
    rule = AdaptiveRule(params, has_head)
    rule.head.update(rng.uniform(0, 8), rng.randint(0, 5))
    rule.text.update(rng.uniform(0, 8), rng.uniform(0, 8))
    text = random_text(rng)
    assert rule.choose(text) == plain_choice(params, rule.head.value, rule.text.value, text, has_head)


def test_every_kind_of_choice_is_made_where_it_pays():
    params = RuleParams(verify_ms=(10.0, 12.0, 14.0, 16.0, 18.0), draft_ms=3.0, head_nodes=2, head_accept=1.0)
    rule = AdaptiveRule(params, True)
    sure = TextDraft(tuple((1,) * (i + 1) for i in range(16)), (1.0,) * 16, 8)  # a long certain repeat
    assert rule.choose(sure) == Choice(False, 16)
    assert rule.choose(TextDraft()) == Choice(True, 0)  # no text: the head alone
    rule.head.update(0.0, 1000)  # a request where the head is never right
    assert rule.choose(TextDraft()) == Choice(False, 0)  # plain steps
    assert AdaptiveRule(params, False).choose(TextDraft()) == Choice(False, 0)
    cheap = RuleParams((10.0, 10.5, 11.0, 11.5, 12.0, 12.5), draft_ms=1.0, head_nodes=2, head_accept=2.0, overlap=0.5)
    unsure = TextDraft(((5,), (5, 6)), (0.6, 0.5), 1)  # where extra nodes cost little, both sources
    assert AdaptiveRule(cheap, True).choose(unsure) == Choice(True, 2)
    round_trip = RuleParams.from_record(params.to_record())
    assert round_trip == params


def test_text_nodes_on_the_heads_path_are_priced_once():
    """A text as sure of two tokens as the head is: merged, the two are the head's nodes, so both
    sources cost what the head's tree alone costs and beat the text alone; priced as nodes of their
    own (shared 0, a calibration before the term) the text alone wins."""
    params = RuleParams((10.0, 14.0, 18.0, 22.0, 26.0), draft_ms=1.0, head_nodes=2, head_accept=2.0, overlap=0.5)
    text = TextDraft(((5,), (5, 6)), (1.0, 1.0), 4)
    merged = dataclasses.replace(params, shared=1.0)
    costs = {c: cost for c, _, cost in AdaptiveRule(merged, True).options(text)}
    assert costs[Choice(True, 2)] == costs[Choice(True, 0)] == pytest.approx(18.0 + 1.0)
    assert AdaptiveRule(merged, True).choose(text) == Choice(True, 2)
    assert AdaptiveRule(params, True).choose(text) == Choice(False, 2)
    assert RuleParams.from_record(merged.to_record()) == merged


def test_the_text_ratio_is_read_by_matched_length_and_budget():
    table = ((0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7), (1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7))
    params = RuleParams((10.0,), 1.0, 1, 1.0, text_ratio=9.0, text_ratios=table)
    draft = TextDraft(tuple((1,) * (i + 1) for i in range(16)), (0.5,) * 16, 1)
    assert params.text_expected(draft, 3) == pytest.approx(0.4 * 1.5)  # budget 4's column holds 3 nodes
    assert params.text_expected(draft, 16) == pytest.approx(0.7 * 8.0)
    long = TextDraft(draft.paths, draft.scores, 7)  # longer matches read the last row
    assert params.text_expected(long, 1) == pytest.approx(1.2 * 0.5)
    assert params.text_expected(long, 0) == 0.0
    assert RuleParams((10.0,), 1.0, 1, 1.0, text_ratio=0.5).text_expected(long, 2) == pytest.approx(0.5)
