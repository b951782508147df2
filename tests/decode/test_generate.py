"""The generation loop: tree-verified greedy decoding must equal the target's own greedy decoding,
token for token, whatever the drafts; sampled decoding must follow the target's distribution."""

import copy
import dataclasses
import random
from collections import Counter

import pytest
import torch
from conftest import (
    POLICIES,
    PlantedText,
    assert_first_two_tokens_follow,
    greedy_sequences,
    hf_greedy,
    quick_head,
)

from specheads.decode.baselines import PlainDrafter
from specheads.decode.drafters import (
    EagleDrafter,
    HybridDrafter,
    MedusaDrafter,
    SequentialDrafter,
    grow_tree,
    make_drafter,
    text_continuations,
)
from specheads.decode.generate import SamplingConfig, speculative_generate, tau_of
from specheads.decode.hybrid_rule import AdaptiveRule, Choice, RuleParams
from specheads.decode.policy import DynamicTreeSpec, HybridPolicy
from specheads.decode.tree import TreeLayout, merge_chains, static_tree
from specheads.kernels import gqa_attention, weight_int8
from specheads.kernels.linear_layout import (
    PACKED,
    WEIGHT_LEFT,
    RowLayouts,
    install,
    linear_layers,
    packing_available,
    uninstall,
)
from specheads.target import FrozenTarget, eos_token_ids
from specheads.tiny import tiny_target as build_tiny

FAMILIES = ["medusa", "eagle", "eagle3", "hydra", "peagle", "dflash"]
# the families drafting every depth in one draft forward, and the module method that forward runs
ONE_FORWARD = {"peagle": "draft_step", "dflash": "block_forward", "dspark": "block_forward", "dflash2": "block_forward"}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_target(attn="eager", arch="llama"):
    model, tok = build_tiny(arch)
    if attn != "eager":
        model.set_attn_implementation(attn)
    return FrozenTarget(model, tok, name="tiny-random")


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def sdpa_target():
    return make_target("sdpa")


@pytest.fixture(scope="module")
def sequences(target):
    """Greedy continuations of random prompts: the heads are overfitted on them so that long
    paths get accepted (which is what exercises KV compaction and the draft cache catch-up)."""
    return greedy_sequences(target)


@pytest.fixture(scope="module")
def heads(target, sequences):
    out = {}
    for family in FAMILIES:
        out[family, "untrained"] = quick_head(target, family)
        out[family, "trained"] = quick_head(target, family, sequences, steps=60)
    for family in [f for f in ONE_FORWARD if f not in FAMILIES]:  # DFlash's successors: their own tests cover the rest
        out[family, "trained"] = quick_head(target, family, sequences, steps=60)
    return out


class RandomTreeDrafter:
    """Random tree shapes (chains, wide, deep) filled with random tokens, or with the target's
    greedy token where an oracle is given (so that some paths get accepted)."""

    layer_ids: list = []
    reads_final = False

    def __init__(self, seed, oracle=None, shape="any"):
        self.rng = random.Random(seed)
        self.oracle = oracle
        self.shape = shape

    def start(self, prompt, states, root):
        self.seq = prompt[0].tolist() + [root]

    def advance(self, states, tokens, bonus):
        self.seq += list(tokens[1:]) + [bonus]

    def draft(self, root, prefix_len, max_depth):
        assert prefix_len == len(self.seq) - 1
        rng = self.rng
        n = rng.randint(1, 16)
        shape = self.shape if self.shape != "any" else rng.choice(["chain", "wide", "random"])
        if shape == "chain":
            parents = [-1] + list(range(n - 1))
        elif shape == "wide":
            parents = [-1] + [0] * (n - 1)
        else:
            parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        layout = TreeLayout(tuple(parents))
        tokens = [root]
        for i in range(1, n):
            if self.oracle is not None and rng.random() < 0.6:
                ctx = self.seq + [tokens[a] for a in layout.path_to(parents[i])[1:]]
                tokens.append(self.oracle(ctx))
            else:
                tokens.append(rng.randrange(320))
        return tokens, layout


def greedy_oracle(target):
    def next_token(ctx):
        with torch.no_grad():
            return int(target.model(torch.tensor([ctx])).logits[0, -1].argmax())

    return next_token


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("seed", range(3))
def test_random_trees_give_exact_greedy_output(attn, seed, target, sdpa_target):
    tgt = target if attn == "eager" else sdpa_target
    prompt = torch.randint(0, 256, (1, 6 + seed), generator=torch.Generator().manual_seed(seed))
    ref = hf_greedy(tgt, prompt, 30)
    drafter = RandomTreeDrafter(seed, oracle=greedy_oracle(tgt))
    res = speculative_generate(tgt, drafter, prompt, SamplingConfig(max_new_tokens=30))
    assert res.output_ids == ref
    assert max(res.accept_lengths) > 1  # the oracle drafts did get accepted
    assert sum(res.accept_lengths) == len(ref) - 1
    assert res.target_forwards == len(res.accept_lengths)
    assert res.tau == sum(res.accept_lengths) / res.target_forwards  # mean accept length


@pytest.mark.parametrize("arch", ["qwen3", "gemma", "mistral"])
def test_other_architectures(arch):
    tgt = make_target(arch=arch)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    ref = hf_greedy(tgt, prompt, 16)
    res = speculative_generate(
        tgt, RandomTreeDrafter(1, oracle=greedy_oracle(tgt)), prompt, SamplingConfig(max_new_tokens=16)
    )
    assert res.output_ids == ref


def test_tau_counts_decode_forwards_only():
    assert tau_of(10, 3) == 3.0  # the prefill's token is not a decode forward's
    assert tau_of(1, 0) == 1.0 and tau_of(0, 0) == 1.0  # no decode forward: plain decoding's 1.0
    assert tau_of(20, 6, answers=2) == 3.0  # pooled over two answers


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("trained", ["untrained", "trained"])
def test_heads_give_exact_greedy_output(family, trained, target, heads, sequences):
    head = heads[family, trained]
    prompts = [sequences[1:2, :8], torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])]
    refs = [hf_greedy(target, prompt, 24) for prompt in prompts]
    for name, policy in POLICIES.items():
        drafter = make_drafter(head, policy)
        for prompt, ref in zip(prompts, refs):
            res = speculative_generate(target, drafter, prompt, SamplingConfig(max_new_tokens=24))
            assert res.output_ids == ref, (family, trained, name)
            assert res.tree_sizes[0] > 1
    if trained == "trained":
        res = speculative_generate(
            target, make_drafter(head, POLICIES["chain"]), sequences[1:2, :8], SamplingConfig(max_new_tokens=32)
        )
        assert res.tau > 1.5, (family, res.accept_lengths)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_floored_dynamic_tree_gives_exact_greedy_output(family, target, heads, sequences):
    """A dynamic tree that keeps only nodes above a path probability verifies trees of a size
    that changes from step to step (root alone included); the output must not change."""
    head = heads[family, "trained"]
    prompt = sequences[1:2, :8]
    ref = hf_greedy(target, prompt, 32)
    for floor in (0.05, 0.3):
        policy = DynamicTreeSpec(depth=4, top_k=3, total_tokens=12, min_path_prob=floor)
        res = speculative_generate(target, make_drafter(head, policy), prompt, SamplingConfig(max_new_tokens=32))
        assert res.output_ids == ref, (family, floor)
        assert sum(res.accepted_drafts) > 0, (family, floor)
        # far from the token limit an unfloored tree always has 1 + 12 nodes: the floor cut some
        early = res.tree_sizes[: len(res.tree_sizes) // 2]
        assert min(early) < 13, (family, floor, res.tree_sizes)


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_or_int8_head_on_an_fp32_target_gives_exact_greedy_output(family, precision, target, heads, sequences):
    """infer.py's head_dtype=auto drafts in bf16 under an fp32 target on CPUs with native bf16, and
    head_dtype=int8 on int8 weights: the drafts may change, the output must not, and the head's
    drafts must still be accepted."""
    # a copy of the module's trained head (the same 60 steps), attached to the target as a fresh head is
    head = copy.deepcopy(heads[family, "trained"]).attach(target).to(torch.bfloat16)
    if precision == "int8":
        assert weight_int8.install(head) > 0
    assert head.dtype == torch.bfloat16 and target.dtype == torch.float32
    prompt = sequences[1:2, :8]
    ref = hf_greedy(target, prompt, 32)
    for name, policy in POLICIES.items():
        res = speculative_generate(target, make_drafter(head, policy), prompt, SamplingConfig(max_new_tokens=32))
        assert res.output_ids == ref, (family, name)
        assert sum(res.accepted_drafts) > 0, (family, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_and_max_new_tokens_inside_accepted_paths(family, target, heads, sequences):
    head = heads[family, "trained"]
    prompt = sequences[2:3, :8]
    full = hf_greedy(target, prompt, 32)
    drafter = make_drafter(head, POLICIES["dynamic"])
    # EOS: pretend a token from the middle of the answer is EOS
    for cut in (0, 1, 5, 11, 17):
        eos = full[cut]
        expected = hf_greedy(target, prompt, 32, eos=eos)
        assert expected == full[: full.index(eos) + 1]
        res = speculative_generate(target, drafter, prompt, SamplingConfig(max_new_tokens=32, eos_token_ids=[eos]))
        assert res.output_ids == expected and res.stopped_by == "eos"
    # max_new_tokens: never a token more, also when the accepted path was longer
    for n in (0, 1, 2, 3, 7, 13):
        res = speculative_generate(target, drafter, prompt, SamplingConfig(max_new_tokens=n))
        assert res.output_ids == full[:n]
        assert res.target_forwards == max(0, len(res.accept_lengths))
        assert sum(res.accept_lengths) == max(n - 1, 0)


def test_streaming_callback_and_drafted_flags(target, heads, sequences):
    seen = []
    prompt = sequences[1:2, :8]
    res = speculative_generate(
        target,
        make_drafter(heads["eagle", "trained"], POLICIES["chain"]),
        prompt,
        SamplingConfig(max_new_tokens=24),
        on_step=lambda t, d: seen.append((t, d)),
    )
    assert [t for ts, _ in seen for t in ts] == res.output_ids
    assert [d for _, ds in seen for d in ds] == res.drafted
    assert res.drafted[0] is False  # the prefill's token is the target's own
    # per step: accepted drafts, then the target's own token (the last step may be cut short)
    for _ts, ds in seen[1:-1]:
        assert ds == [True] * (len(ds) - 1) + [False]
    assert all(seen[-1][1][:-1])
    assert any(len(ts) > 1 for ts, _ in seen)


def test_typical_acceptance_is_opt_in_and_respects_limits(target, heads, sequences):
    head = heads["medusa", "trained"]
    cfg = SamplingConfig(max_new_tokens=20, temperature=0.3, acceptance="typical")
    assert cfg.rule() == "typical" and SamplingConfig(temperature=0.7).rule() == "speculative"
    res = speculative_generate(
        target,
        make_drafter(head, POLICIES["chain"]),
        sequences[1:2, :8],
        cfg,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(res.output_ids) == 20 and max(res.accepted_drafts) >= 1
    assert sum(res.accept_lengths) == 19


def self_drafter(target, policy):
    """Drafts the target's own top-ranked tokens (deterministically) into `policy`'s tree."""
    model = target.model

    class SelfDrafter:
        layer_ids: list = []
        reads_final = False

        def start(self, prompt, states, root):
            self.seq = prompt[0].tolist() + [root]

        def advance(self, states, tokens, bonus):
            self.seq += list(tokens[1:]) + [bonus]

        def draft(self, root, prefix_len, max_depth):
            def child_logp(ids, table):
                ctxs = [tuple(self.seq + [table.tokens[a] for a in _path(table, i)[1:]]) for i in ids]
                return torch.stack([next_logp(c) for c in ctxs])

            return grow_tree(root, child_logp, lambda x: x, policy, max_depth)

    cache = {}

    def next_logp(ctx):
        if ctx not in cache:
            with torch.no_grad():
                cache[ctx] = model(torch.tensor([ctx])).logits[0, -1].log_softmax(-1)
        return cache[ctx]

    return SelfDrafter()


def _path(table, i):
    path = [i]
    while table.parents[path[-1]] != -1:
        path.append(table.parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9)])
def test_sampled_tokens_follow_the_target_distribution(temperature, top_p, target):
    """End to end: the first two tokens (the second decided by a tree verification)."""

    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    n = 400
    drafter = self_drafter(target, static_tree([[0], [1], [2], [0, 0]]))
    counts, depths = first_two_samples(target, drafter, prompt, n, temperature, top_p)
    assert depths[0] > n * 0.1 and depths[1] + depths[2] > n * 0.3  # drafts both accepted and rejected
    assert_first_two_tokens_follow(counts, *first_two_probs(target, prompt, temperature, top_p), n)


def first_two_samples(target, drafter, prompt, n, temperature, top_p):
    """Counts of the first two sampled tokens over n runs, and of the drafts accepted for the second:
    3 new tokens, the root from the prefill and the next two from one tree verification."""
    gen = torch.Generator().manual_seed(7)
    cfg = SamplingConfig(max_new_tokens=3, temperature=temperature, top_p=top_p)
    counts, accepted = Counter(), Counter()
    for _ in range(n):
        res = speculative_generate(target, drafter, prompt, cfg, generator=gen)
        counts[tuple(res.output_ids[:2])] += 1
        accepted[res.accepted_drafts[0]] += 1
    return counts, accepted


def first_two_probs(target, prompt, temperature, top_p):
    """The target's sampling distributions of the first token, and of the second after each first."""
    from specheads.sampling import sampling_probs

    with torch.no_grad():
        p1 = sampling_probs(target.model(prompt).logits[0, -1], temperature, top_p)
        firsts = torch.arange(320)
        batch = torch.cat([prompt.expand(320, -1), firsts[:, None]], dim=1)
        p2 = sampling_probs(target.model(batch).logits[:, -1], temperature, top_p)
    return p1, p2


class FutureOracleDrafter:
    """Random trees in which one random path carries the true continuation (known in advance)
    to a random depth: long accepted paths at arbitrary tree positions, no model calls."""

    layer_ids: list = []
    reads_final = False

    def __init__(self, reference: list[int], vocab: int, seed: int = 0):
        self.ref, self.vocab, self.rng = reference, vocab, random.Random(seed)

    def start(self, prompt, states, root):
        pass

    def advance(self, states, tokens, bonus):
        pass

    def draft(self, root, prefix_len, max_depth):
        rng = self.rng
        parents, tokens, true_node = [-1], [root], 0
        truth = self.ref[prefix_len + 1 : prefix_len + 1 + rng.randint(0, 6)]
        for _ in range(rng.randint(0, 20)):
            parents.append(rng.randrange(len(tokens)))
            tokens.append(rng.randrange(self.vocab))
        for t in truth:  # hang the true chain below a random node on the way
            parents.append(true_node)
            tokens.append(t)
            true_node = len(tokens) - 1
        return tokens, TreeLayout(tuple(parents))


@pytest.mark.slow
def test_real_target_tree_verification_matches_greedy(smollm2_target):
    tgt = smollm2_target
    ids = tgt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three uses of copper."}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    prompt = torch.tensor([ids])
    ref = hf_greedy(tgt, prompt, 40)
    drafter = FutureOracleDrafter(ids + ref, tgt.info.vocab_size)
    res = speculative_generate(tgt, drafter, prompt, SamplingConfig(max_new_tokens=40))
    assert res.output_ids == ref
    assert res.tau > 2  # long paths were accepted and compacted


KERNELS = [
    WEIGHT_LEFT,
    pytest.param(
        PACKED,
        marks=pytest.mark.skipif(
            not packing_available(torch.zeros(1)), reason="oneDNN (mkldnn) linear is not available in this torch"
        ),
    ),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seed", range(3))
def test_linear_kernels_keep_greedy_output(seed, kernel, sdpa_target):
    """Every linear layer on the kernel under test at every row count of the ladder, and masked
    attention with unrepeated KV heads, against the target's greedy output as transformers ships it."""
    target = sdpa_target
    prompt = torch.randint(0, 256, (1, 5 + seed), generator=torch.Generator().manual_seed(10 + seed))
    ref = hf_greedy(target, prompt, 30)
    routed = install(target.model, RowLayouts.everywhere(kernel))
    assert gqa_attention.install(target.model)
    try:
        assert routed == len(linear_layers(target.model))
        drafter = RandomTreeDrafter(seed, oracle=greedy_oracle(target))
        res = speculative_generate(target, drafter, prompt, SamplingConfig(max_new_tokens=30))
    finally:
        uninstall(target.model)
        gqa_attention.uninstall(target.model)
    assert res.output_ids == ref
    assert max(res.accept_lengths) > 1  # multi-row verifications went through the routed path


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_real_target_linear_kernels_match_greedy(kernel, smollm2_target):
    tgt = smollm2_target
    ids = tgt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write two sentences about rivers."}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    prompt = torch.tensor([ids])
    ref = hf_greedy(tgt, prompt, 40)
    install(tgt.model, RowLayouts.everywhere(kernel))
    installed = gqa_attention.install(tgt.model)
    try:
        res = speculative_generate(
            tgt, FutureOracleDrafter(ids + ref, tgt.info.vocab_size), prompt, SamplingConfig(max_new_tokens=40)
        )
        plain = speculative_generate(tgt, PlainDrafter(), prompt, SamplingConfig(max_new_tokens=40))
    finally:
        uninstall(tgt.model)
        gqa_attention.uninstall(tgt.model)
    assert installed and res.output_ids == ref and res.tau > 2
    assert plain.output_ids == ref  # one row at a time on the kernel: the same greedy output


@pytest.mark.parametrize("drafts", ["random", *FAMILIES])
def test_hybrid_trees_give_exact_greedy_output(drafts, target, heads, sequences):
    """Random trees from both sources, merged: the target's own greedy output, fp32."""
    accepted = Counter()
    for seed in range(3):
        rng = random.Random(seed)
        prompt = sequences[1 + seed : 2 + seed, :8]  # the heads were fitted on its continuation
        ref = hf_greedy(target, prompt, 30)
        if drafts == "random":
            inner = RandomTreeDrafter(seed, oracle=greedy_oracle(target))
        else:
            inner = make_drafter(heads[drafts, "trained"], POLICIES[rng.choice(list(POLICIES))])
        answer = [t if rng.random() < 0.7 else rng.randrange(320) for t in ref]
        policy = HybridPolicy(None, ngram_nodes=rng.randint(1, 12), ngram_max=rng.randint(1, 3))
        drafter = PlantedText(inner, policy, prompt[0].tolist() + answer)
        res = speculative_generate(target, drafter, prompt, SamplingConfig(max_new_tokens=30))
        assert res.output_ids == ref, seed
        # every drafted token that reached the output is counted once, under its source
        emitted = sum(min(e, a) for e, a in zip(res.accept_lengths, res.accepted_drafts))
        assert sum(res.accepted_sources.values()) == emitted
        accepted.update(res.accepted_sources)
    # both drafters' nodes were accepted
    assert accepted["text"] + accepted["both"] > 0 and accepted["head"] + accepted["both"] > 0, accepted


class RecordingText(PlantedText):
    """PlantedText that records every step's tree (tokens and parents) and its text-alone steps."""

    def __init__(self, inner, policy, planted):
        super().__init__(inner, policy, planted)
        self.trees, self.alone = [], 0

    def draft(self, root, prefix_len, max_depth):
        p = self.policy
        found = text_continuations(self.text, p.ngram_max, p.text_alone, max_depth, p.alone_ngram)
        alone = bool(p.text_alone and found)
        self.alone += alone
        tokens, layout = self.draft_tree(root, prefix_len, max_depth, alone)
        self.trees.append((tuple(tokens), layout.parents))
        return tokens, layout

    def draft_tree(self, root, prefix_len, max_depth, alone):
        return HybridDrafter.draft(self, root, prefix_len, max_depth)


class FedEveryStep(RecordingText):
    """The plain way: on a text-alone step the head still drafts (and so is fed); its tree is dropped."""

    def draft_tree(self, root, prefix_len, max_depth, alone):
        if alone:
            self.inner.draft(root, prefix_len, max_depth)
        return HybridDrafter.draft(self, root, prefix_len, max_depth)


def text_alone_runs(target, head, prompt, planted, policy, n=30):
    runs = []
    for kind in (RecordingText, FedEveryStep):
        drafter = kind(make_drafter(head, POLICIES["wide"]), policy, planted)
        res = speculative_generate(target, drafter, prompt, SamplingConfig(max_new_tokens=n))
        runs.append((drafter, res))
    return runs


def hydra_prefix_head(target):
    from specheads.config.train import HeadConfig
    from specheads.heads import build_head

    torch.manual_seed(0)
    head = build_head(HeadConfig(family="hydra", num_heads=4, hydra_prefix_layer=True), target)
    with torch.no_grad():
        for q in head.parameters():
            q.add_(0.05 * torch.randn_like(q))
    return head.eval()


@pytest.mark.parametrize("family", [*FAMILIES, "hydra-prefix"])
def test_text_alone_steps_skip_the_head_and_keep_its_state(family, target, heads, sequences):
    """A step that drafts the text's repeat alone skips the head; the positions it accepts reach
    the head at its next draft, so every later tree equals the one of a head fed at every step
    (the plain way), and the output is the target's own greedy output, fp32. Each family's wrong
    variant fails this comparison (test_the_text_alone_check_fails_for_a_drafter_that_loses_a_skipped_step)."""
    head = hydra_prefix_head(target) if family == "hydra-prefix" else heads[family, "trained"]
    alone_steps = head_accepted = 0
    for seed in range(3):
        rng = random.Random(seed)
        prompt = sequences[1 + seed : 2 + seed, :8]
        ref = hf_greedy(target, prompt, 30)
        answer = [t if rng.random() < 0.8 else rng.randrange(320) for t in ref]
        ngram_max = rng.randint(2, 3)
        policy = HybridPolicy(None, 2, ngram_max, text_alone=rng.randint(2, 8), alone_ngram=rng.randint(1, ngram_max))
        (skipping, res), (fed, res_fed) = text_alone_runs(target, head, prompt, prompt[0].tolist() + answer, policy)
        assert res.output_ids == ref and res_fed.output_ids == ref, seed
        assert skipping.trees == fed.trees, seed
        alone_steps += skipping.alone
        head_accepted += res.accepted_sources.get("head", 0) + res.accepted_sources.get("both", 0)
    assert alone_steps > 0  # steps were drafted from the text alone
    if family != "hydra-prefix":  # (an untrained head: its trees are compared, not accepted)
        assert head_accepted > 0  # and the head drafted, and was accepted, around them


def forgets_a_skipped_step(family, monkeypatch):
    """A wrong drafter for `family` that the comparison above must catch: an EAGLE-style drafter
    (and a Hydra prefix layer) that drops the positions a skipped step left queued; a drafter that
    reads only the last state (Medusa, Hydra without a prefix layer: their trees are a function of
    it, so skipping their draft changes nothing by construction) that takes in a step's states only
    after steps it drafted itself."""
    if family in ("eagle", "eagle3", "peagle", "dflash"):

        def forgetful(self, states, tokens, bonus):
            ids = torch.tensor([list(tokens[1:]) + [bonus]], dtype=torch.long, device=self.cache_device)
            self.pending = (ids, self._features(states))  # overwrites what the skipped step left

        monkeypatch.setattr(EagleDrafter, "advance", forgetful)
        return
    if family == "hydra-prefix":
        monkeypatch.setattr(
            SequentialDrafter, "advance", lambda self, states, tokens, bonus: setattr(self, "pending", states["final"])
        )
        return
    cls = MedusaDrafter if family == "medusa" else SequentialDrafter
    draft, advance = cls.draft, cls.advance

    def drafted(self, *args):
        self.drafted = True
        return draft(self, *args)

    def after_own_drafts(self, states, tokens, bonus):
        if getattr(self, "drafted", True):
            advance(self, states, tokens, bonus)
        self.drafted = False

    monkeypatch.setattr(cls, "draft", drafted)
    monkeypatch.setattr(cls, "advance", after_own_drafts)


@pytest.mark.parametrize("family", [*FAMILIES, "hydra-prefix"])
def test_the_text_alone_check_fails_for_a_drafter_that_loses_a_skipped_step(
    family, target, heads, sequences, monkeypatch
):
    """The comparison of test_text_alone_steps_skip_the_head_and_keep_its_state, run with a drafter
    of each family that loses what a skipped step should have passed on: the trees differ."""
    head = hydra_prefix_head(target) if family == "hydra-prefix" else heads[family, "trained"]
    forgets_a_skipped_step(family, monkeypatch)
    differ = 0
    for seed in range(3):
        rng = random.Random(seed)
        prompt = sequences[1 + seed : 2 + seed, :8]
        ref = hf_greedy(target, prompt, 30)
        answer = [t if rng.random() < 0.8 else rng.randrange(320) for t in ref]
        policy = HybridPolicy(None, ngram_nodes=2, ngram_max=2, text_alone=6)
        planted = prompt[0].tolist() + answer
        (skipping, _), (fed, _) = text_alone_runs(target, head, prompt, planted, policy)
        differ += skipping.trees != fed.trees
    assert differ > 0


@pytest.mark.slow
def test_real_target_hybrid_without_a_head_matches_greedy(smollm2_target):
    """The text's own repeats on the real target: a quoted sentence is drafted from the prompt."""
    tgt = smollm2_target
    ids = tgt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    prompt = torch.tensor([ids])
    ref = hf_greedy(tgt, prompt, 20)
    drafter = HybridDrafter(None, HybridPolicy(None, ngram_nodes=8, ngram_max=3))
    cfg = SamplingConfig(max_new_tokens=20, eos_token_ids=eos_token_ids(tgt))  # the answer is short
    res = speculative_generate(tgt, drafter, prompt, cfg)
    assert res.output_ids == ref
    assert res.accepted_sources.get("text", 0) > 0 and res.tau > 1


def accepts_one_child_too_many(tokens, layout, target_logits):
    """A wrong greedy rule: after the right path, also takes the next node's first child."""
    from specheads.decode.verify import Acceptance, greedy_accept

    right = greedy_accept(tokens, layout, target_logits)
    children = layout.children[right.path[-1]]
    if not children:
        return right
    child = children[0]
    return Acceptance((*right.path, child), int(target_logits[child].argmax()))


def parallel_head_outputs(target, head, prompt):
    """(policy name, output ids, accepted drafts) of a parallel head under each test tree."""
    out = []
    for name, policy in POLICIES.items():
        res = speculative_generate(target, make_drafter(head, policy), prompt, SamplingConfig(max_new_tokens=32))
        out.append((name, res.output_ids, sum(res.accepted_drafts)))
    return out


@pytest.mark.parametrize("family", ONE_FORWARD)
def test_a_parallel_head_drafts_every_depth_in_one_forward_and_stays_exact(
    family, target, heads, sequences, monkeypatch
):
    """P-EAGLE, DFlash, DSpark, DFlash2: one draft forward per step (not one per level), chains and trees accepted,
    the output the target's own; a verifier that takes one node too many visibly breaks it."""
    head = heads[family, "trained"]
    prompt = sequences[1:2, :8]
    ref = hf_greedy(target, prompt, 32)
    calls = []
    original = getattr(head, ONE_FORWARD[family])
    monkeypatch.setattr(head, ONE_FORWARD[family], lambda *a, **k: calls.append(1) or original(*a, **k))
    res = speculative_generate(target, make_drafter(head, POLICIES["wide"]), prompt, SamplingConfig(max_new_tokens=32))
    assert len(calls) == res.target_forwards and res.output_ids == ref
    monkeypatch.undo()
    for name, output, accepted in parallel_head_outputs(target, head, prompt):
        assert output == ref and accepted > 0, name
    import specheads.decode.generate as generate

    monkeypatch.setattr(generate, "greedy_accept", accepts_one_child_too_many)
    # (also off the fitted text: there a head that drafts every depth right leaves no child to take)
    other = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    broken = [(o, ref) for _, o, _ in parallel_head_outputs(target, head, prompt)]
    broken += [(o, hf_greedy(target, other, 32)) for _, o, _ in parallel_head_outputs(target, head, other)]
    assert any(output != expected for output, expected in broken)


def accepts_any_draft_in_support(tokens, layout, target_probs, draft_probs=None, generator=None, one_hot=None):
    """A wrong sampling rule: a child the target could sample is always accepted."""
    from specheads.decode.verify import Acceptance

    node, path = 0, [0]
    while True:
        p = target_probs[node].float()
        child = next((c for c in layout.children[node] if p[tokens[c]] > 0), None)
        if child is None:
            return Acceptance(tuple(path), int(torch.multinomial(p, 1, generator=generator)))
        node = child
        path.append(child)


@pytest.mark.parametrize("family", ONE_FORWARD)
def test_a_parallel_head_samples_the_target_distribution(family, target, heads, sequences, monkeypatch):
    """Sampling with P-EAGLE, DFlash, DSpark or DFlash2 drafts (DSpark's and DFlash2's trees each
    node's children from its own token): the first two tokens follow the target's joint
    distribution (the chi-square of the other families), with drafts both accepted and rejected; a
    rule that accepts every draft in the target's support fails the same check."""
    drafter = make_drafter(heads[family, "trained"], static_tree([[0], [1], [2], [0, 0]]))
    prompt = sequences[1:2, :12]  # inside the text the head was fitted on: its drafts get accepted
    temperature, top_p, n = 0.5, 0.9, 200
    p1, p2 = first_two_probs(target, prompt, temperature, top_p)
    counts, accepted = first_two_samples(target, drafter, prompt, n, temperature, top_p)
    assert n * 0.15 < accepted[0] < n * 0.85, accepted
    assert_first_two_tokens_follow(counts, p1, p2, n)
    import specheads.decode.generate as generate

    monkeypatch.setattr(generate, "speculative_accept", accepts_any_draft_in_support)
    counts, _ = first_two_samples(target, drafter, prompt, n, temperature, top_p)
    with pytest.raises(AssertionError):
        assert_first_two_tokens_follow(counts, p1, p2, n)


class OldHybrid(PlantedText):
    """The hybrid drafter's draft step as it was before the per-step rule and the suffix source
    (n-gram continuations, a fixed split, the text alone after a repeat): the reference that the
    fixed rule over the n-gram source must reproduce exactly."""

    def draft(self, root, prefix_len, max_depth):
        p = self.policy
        if p.text_alone and self.inner is not None:
            alone = text_continuations(self.text, p.ngram_max, p.text_alone, max_depth, min_ngram=p.alone_ngram)
            if alone:
                tokens, layout, self.sources = merge_chains([root], TreeLayout((-1,)), alone)
                return tokens, layout
        if self.inner is not None:
            tokens, layout = self.inner.draft(root, prefix_len, max_depth)
        else:
            tokens, layout = [root], TreeLayout((-1,))
        chains = text_continuations(self.text, p.ngram_max, p.ngram_nodes, max_depth)
        tokens, layout, self.sources = merge_chains(tokens, layout, chains)
        return tokens, layout


class ForcedRule(AdaptiveRule):
    """The adaptive rule forced to one choice every step."""

    def __init__(self, params, has_head, choice):
        super().__init__(params, has_head)
        self.forced = choice

    def choose(self, text):
        return Choice(self.forced.head, min(self.forced.text_nodes, len(text.paths)))


RULE = RuleParams(verify_ms=(10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0), draft_ms=2.0, head_nodes=3, head_accept=1.0)


def run_counts(target, drafter, prompt, n=30, cfg=None):
    res = speculative_generate(target, drafter, prompt, cfg or SamplingConfig(max_new_tokens=n))
    return res, (res.output_ids, res.accept_lengths, res.accepted_drafts, res.tree_sizes, res.accepted_sources)


def planted_answer(target, sequences, seed, keep=0.8):
    rng = random.Random(seed)
    prompt = sequences[1 + seed : 2 + seed, :8]
    ref = hf_greedy(target, prompt, 30)
    return rng, prompt, ref, prompt[0].tolist() + [t if rng.random() < keep else rng.randrange(320) for t in ref]


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_a_fixed_rule_reproduces_the_old_hybrid_and_lookup_exactly(family, target, heads, sequences):
    """The fixed split over the n-gram source is the hybrid drafter as it was: the same output,
    accept lengths, tree sizes and accepted sources, step for step; without a head, prompt lookup's."""
    head = heads[family, "trained"]
    sources = Counter()
    for seed in range(3):
        rng, prompt, ref, planted = planted_answer(target, sequences, seed)
        policy = HybridPolicy(None, rng.randint(1, 8), rng.randint(2, 3), text_alone=rng.choice([0, 4, 8]))
        for inner in (make_drafter(head, POLICIES["wide"]), None):
            old = run_counts(target, OldHybrid(inner, policy, planted), prompt)
            inner = make_drafter(head, POLICIES["wide"]) if inner is not None else None
            new = run_counts(target, PlantedText(inner, policy, planted), prompt)
            assert new[1] == old[1] and new[0].output_ids == ref, (seed, inner is None)
            sources.update(new[0].accepted_sources)
    assert sources["text"] > 0 and sources["head"] + sources["both"] > 0  # both sources were exercised


@pytest.mark.parametrize("family", ["eagle3", "medusa"])
def test_a_forced_rule_drafts_what_the_fixed_split_drafts(family, target, heads, sequences):
    """The adaptive path forced to (head, g text nodes) every step is the fixed split with g suffix
    nodes; forced to (no head, g) without a head it is the suffix source alone: same counts."""
    head = heads[family, "trained"]
    for seed in range(3):
        rng, prompt, ref, planted = planted_answer(target, sequences, seed)
        g = rng.randint(1, 8)
        fixed = HybridPolicy(None, g, 3, text_alone=0, source="suffix")
        adaptive = dataclasses.replace(fixed, rule=RULE)
        for with_head in (True, False):
            inner = (lambda: make_drafter(head, POLICIES["wide"])) if with_head else (lambda: None)
            expected = run_counts(target, PlantedText(inner(), fixed, planted), prompt)
            forced = PlantedText(inner(), adaptive, planted)
            forced.rule = ForcedRule(RULE, with_head, Choice(with_head, g))
            got = run_counts(target, forced, prompt)
            assert got[1] == expected[1] and got[0].output_ids == ref, (seed, with_head)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adaptive_hybrid_gives_exact_greedy_output(family, target, heads, sequences):
    """Whatever the rule chooses step by step (plain, the text alone, the head, both): the target's
    own greedy output, fp32; the steps made more than one kind of choice and both sources were accepted."""
    head = heads[family, "trained"]
    choices, sources = Counter(), Counter()
    for seed in range(4):
        rng, prompt, ref, planted = planted_answer(target, sequences, seed, keep=rng_keep(seed))
        params = dataclasses.replace(RULE, head_accept=rng.uniform(0.2, 3.0), text_ratio=rng.uniform(0.3, 1.0))
        policy = HybridPolicy(None, 8, 3, source="suffix", rule=params)
        drafter = PlantedText(make_drafter(head, POLICIES[rng.choice(list(POLICIES))]), policy, planted)
        res, _ = run_counts(target, drafter, prompt)
        assert res.output_ids == ref, seed
        choices.update(drafter.choices)
        sources.update(res.accepted_sources)
    assert len({(c.head, c.text_nodes > 0) for c in choices}) >= 2, choices
    assert sources["text"] + sources["both"] > 0 and sources["head"] + sources["both"] > 0, sources


def rng_keep(seed):
    """How much of the planted answer is the true one: text worth drafting in some requests only."""
    return (0.95, 0.3, 0.8, 0.0)[seed % 4]


def test_the_adaptive_hybrid_samples_the_target_distribution(target, heads, sequences, monkeypatch):
    """Sampling through the adaptive hybrid (the head's tree merged with the text's nodes): the
    first two tokens follow the target's joint distribution, with drafts of both sources accepted;
    a rule that accepts every draft in the target's support fails the same check."""
    _, prompt, _, planted = planted_answer(target, sequences, 0, keep=1.0)
    prompt = sequences[1:2, :12]
    cheap = dataclasses.replace(RULE, verify_ms=(10.0,) * 7, overlap=0.5)  # every node free: both sources
    policy = HybridPolicy(None, 8, 3, source="suffix", rule=cheap)
    drafter = PlantedText(make_drafter(heads["eagle3", "trained"], static_tree([[0], [1], [0, 0]])), policy, planted)
    temperature, top_p, n = 0.5, 0.9, 200
    p1, p2 = first_two_probs(target, prompt, temperature, top_p)
    counts, accepted = first_two_samples(target, drafter, prompt, n, temperature, top_p)
    assert n * 0.15 < accepted[0] < n * 0.85, accepted
    assert any(c.head and c.text_nodes for c in drafter.choices), drafter.choices  # merged trees
    assert_first_two_tokens_follow(counts, p1, p2, n)
    import specheads.decode.generate as generate

    monkeypatch.setattr(generate, "speculative_accept", accepts_any_draft_in_support)
    counts, _ = first_two_samples(target, drafter, prompt, n, temperature, top_p)
    with pytest.raises(AssertionError):
        assert_first_two_tokens_follow(counts, p1, p2, n)
