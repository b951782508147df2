"""The schema of infer.py (conf/infer.yaml) and its tree group, and the checks a type cannot say.

On infer.py's command line `head=PATH` is a value, not train.py's head config group: infer.py
passes it on as `head_path` before Hydra composes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SpecHeadsError
from .model import ModelConfig

# infer.py's head_dtype (specheads.heads.io.draft_dtype says what each means)
DRAFT_DTYPES = ("auto", "target", "float32", "bfloat16", "float16", "int8")


def check_draft_dtype(name: str, key: str = "head_dtype") -> None:
    if name not in DRAFT_DTYPES:
        raise SpecHeadsError(f"{key} must be one of {', '.join(DRAFT_DTYPES)}, got {name!r}")


TREE_KINDS = ("default", "static", "dynamic", "chain", "auto")
METHODS = ("baseline", "plain", "prompt_lookup", "lookup", "suffix", "spec", "hybrid", "draft", "assisted", "skip")
DEFAULT_METHODS = ("baseline", "plain", "prompt_lookup", "lookup", "spec", "hybrid")
# the methods that draft with draft.model: run by default (after DEFAULT_METHODS) when it is set
DRAFT_MODEL_METHODS = ("draft", "assisted")
# the methods that need a head: left out of the default methods when only draft.model drafts
HEAD_METHODS = ("spec", "hybrid")
DRAFT_MODEL_DTYPES = ("target", "float32", "bfloat16", "float16")
ASSISTANT_SCHEDULES = ("constant", "heuristic", "heuristic_transient")
TREE_SAVES = ("cache", "head", "none")
TREE_DYNAMIC = ("weigh", "off", "only")
TREE_REPLACES = ("if_faster", "always")
HYBRID_RULES = ("adaptive", "fixed")
TEXT_SOURCES = ("suffix", "ngram")
BENCH_MODES = ("timed", "replay")
DEFAULT_BENCH_DIR = "runs/bench"  # where OUT.jsonl goes when bench.output is not given


@dataclass
class TreeConfig:
    """The draft tree: its kind, its sizes, tree=auto's calibration and hybrid's text nodes."""

    # default = the head's stored tree, else dynamic (EAGLE) or a static Medusa tree; static = `paths`;
    # dynamic = EAGLE-2 (depth, top_k, total_tokens); chain = a top-1 chain of depth; auto = calibrated
    # on this machine (target cost per tree size x head acceptance per rank)
    kind: str = "default"
    paths: list[Any] | None = None  # static: rank paths, Medusa's `choices` format ([[0],[1],[0,0]])
    # levels drafted (chain: tokens; auto: the deepest path considered); None: 5, and for tree=auto
    # the depth the head's calibration searched (like every key of its search: see SEARCH_DEFAULTS)
    depth: int | None = None
    top_k: int | None = None  # dynamic: children expanded per node (auto: the widest rank considered); None: 8
    total_tokens: int = 32  # dynamic: nodes kept and verified (the root is extra)
    # a static tree's next level is drafted only while a path into it has at least this probability
    # under the head (0: every level, every step); None: the value calibrated with the head's tree
    # (tree=auto, stored with it), else 0. A dynamic tree drafts and keeps only the nodes whose
    # path has at least this probability.
    min_path_prob: float | None = None
    # auto calibration
    calibration_questions: str | None = None  # auto: a question.jsonl to calibrate on; None = built-in prompts
    # auto: prompts the head's acceptance is measured on. tree=auto's search (this key, depth, top_k,
    # max_nodes, dynamic, calibration_tokens): a key left None takes what the head's calibration
    # searched (this machine's cached one, else config.json's), else its SEARCH_DEFAULTS value (here 8)
    calibration_prompts: int | None = None
    calibration_tokens: int | None = None  # auto: tokens answered per calibration prompt; None: 48
    max_nodes: int | None = None  # auto: the largest tree (and target forward) timed; None: 64
    # tree=auto and EAGLE-2 dynamic trees with a floor (bench/dynamic_trees.py): weigh = choose one
    # when it is expected to be faster than the static tree; off = static trees only; only = the
    # best dynamic tree (top_k up to tree.top_k). The static tree is stored either way (engines
    # export it). None: weigh
    dynamic: str | None = None
    # hybrid (the head's tree + what followed the text's last n-gram earlier in the prompt and
    # answer, one tree): the longest n-gram matched (shorter ones after it)
    ngram_max: int = 3
    ngram_nodes: int | None = None  # hybrid: text nodes per step; None = the calibrated share, else 8
    # hybrid: the head's part of the tree, set by tree=auto; None = the head's tree as above, [] = no head nodes
    hybrid_paths: list[Any] | None = None
    # hybrid: the depth gate of hybrid_paths (set by tree=auto with them); None: tree.min_path_prob, else 0
    hybrid_min_path_prob: float | None = None
    # > 0: when the text's last text_alone_ngram tokens (or more, up to ngram_max) occurred before,
    # the step drafts what followed them, text_alone nodes at most, without the head (a long repeat
    # is then verified as cheaply as prompt lookup's chain); 0: every step drafts the merged tree.
    # None: the calibrated rule (tree=auto, or stored with the head), else 8 nodes after a repeated
    # ngram_max-gram
    text_alone: int | None = None
    text_alone_ngram: int | None = None  # hybrid: the repeated n-gram length that triggers text_alone
    # hybrid's text source: suffix = the longest repeated suffix of the text (up to suffix_match
    # tokens), its continuations scored by how often they followed it, over the request's text and
    # up to suffix_history tokens of this process's earlier answers (0: the request's own text
    # only); ngram = prompt lookup's most recent matches of the last n-gram (n <= ngram_max)
    text_source: str = "suffix"
    suffix_match: int = 8  # suffix: the longest repeated suffix matched, in tokens
    suffix_history: int = 16384  # suffix: tokens of earlier answers indexed (0: the request's own text only)
    # adaptive = each step chooses the head's tree, the text's nodes, both or neither, and how many
    # text nodes, from the calibrated costs and this request's acceptance so far (needs a tree=auto
    # calibration with a hybrid rule; without one, the fixed split); fixed = the calibrated split
    # every step (ngram_nodes merged, text_alone after a repeat)
    hybrid_rule: str = "adaptive"
    # where tree=auto keeps the tree: cache = this machine's cache (tree=default uses it for this
    # head here; the head directory keeps the tree it came with); head = the head directory's own
    # default tree (config.json rewritten: for a head you just trained); none = this run only
    save: str = "cache"
    # when tree=auto calibrates a head that has a calibration already (this machine's cached one, else
    # config.json's): if_faster = the new one replaces it only where it is expected faster on the
    # positions and costs just measured, each part on its own (the tree tree=default drafts, the
    # hybrid split), and only when measured on at least as many positions (else nothing changes);
    # one line says what is kept. always (or true) = the new one replaces it whatever they measure
    replace: str = "if_faster"


# tree=auto's search (and tree=dynamic/chain's depth and top_k) where neither the command line nor
# the head's calibration record sets a key
SEARCH_DEFAULTS: dict[str, Any] = {
    "depth": 5,
    "top_k": 8,
    "max_nodes": 64,
    "dynamic": "weigh",
    "calibration_prompts": 8,
    "calibration_tokens": 48,
}


def resolve_search(tree: TreeConfig, recorded: dict[str, Any] | None = None) -> TreeConfig:
    """The tree settings with every search key left None filled: from `recorded` (what a head's
    calibration searched, bench.trees.search_space: tree=auto searches it again), else from
    SEARCH_DEFAULTS. The one place these keys are resolved; a key given explicitly is kept."""
    recorded = recorded or {}
    fill = {
        k: recorded[k] if recorded.get(k) is not None else default
        for k, default in SEARCH_DEFAULTS.items()
        if getattr(tree, k) is None
    }
    return dataclasses.replace(tree, **fill) if fill else tree


@dataclass
class BenchConfig:
    """The benchmark: every method on a question set, timed or replayed (bench.questions turns it on)."""

    # timed: every method decodes every question, timed (OUT.jsonl, OUT.summary.json); replay:
    # the target's greedy answers are written once (OUT.greedy.jsonl) and the head and bench.heads
    # replayed on them: the exact tau of every chain length and static tree, nothing timed
    # (OUT.replay.json, specheads.bench.replay)
    mode: str = "timed"
    # a FastChat question.jsonl, or SPEED-Bench: nvidia/SPEED-Bench[:CONFIG] or a file or directory in its
    # schema (docs/benchmarking.md); the benchmark runs when it is set
    questions: str | None = None
    output: str | None = None  # None = runs/bench/<questions file stem>.jsonl
    max_new_tokens: int = 256  # tokens answered per question (and turn)
    # baseline (HF greedy), plain (our own loop, no drafts), prompt_lookup (HF's), lookup (prompt
    # lookup through our own loop), suffix (the suffix text source alone, bench.prompt_lookup_num_tokens
    # nodes, through our own loop), spec (the head), hybrid (the head + the text's repeats), draft
    # (draft.model drafting through our own loop, chain or tree per the tree settings), assisted
    # (transformers generate with assistant_model=draft.model), skip (the target with skip.layers
    # skipped). With draft.model (skip.layers) set and this list left as it is, draft and assisted
    # (skip) are added, and spec and hybrid dropped without a head
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    prompt_lookup_num_tokens: int = 10  # prompt_lookup: tokens drafted per step
    prompt_lookup_max_ngram: int = 2  # prompt_lookup: the longest n-gram matched
    limit: int | None = None  # only the first N questions
    per_category: int | None = None  # only the first N questions of every category
    # only these categories ([] = all): a benchmark too long for one sitting split into runs, each
    # timing all its methods on every one of its questions
    categories: list[str] = field(default_factory=list)
    # first: each question's first turn; all: every turn, each after the method's own answers to
    # the turns before it (MT-bench turn 2 as the EAGLE and Spec-Bench harnesses run it)
    turns: str = "first"
    warmup: int = 1  # questions run per method before timing starts
    # CPU targets: MiB copied between two buffers before each question, timed, to sample the
    # machine's memory bandwidth (rows' copy_gb_s, the summary's memory_bandwidth); 0 = off
    bandwidth_mib: int = 256
    plots: bool = True  # write OUT.tau.png and OUT.acceptance.png
    # more head directories (same target) run side by side as methods spec:<name>, each with its
    # own stored tree, against the same baselines in the same run
    heads: list[str] = field(default_factory=list)
    # the session's head again in other precisions (head_dtype values), as methods spec@<dtype>
    # with the main head's tree: what the drafting precision is worth, measured in one run
    head_dtypes: list[str] = field(default_factory=list)
    # the session's head again with other trees (parse_tree_spec: chain:K, dynamic:DEPTH:TOP_K:NODES[:P],
    # static:[[0],[1],[0,0]], default), as methods spec#<spec>: what the tree is worth, in one run
    trees: list[str] = field(default_factory=list)
    # an earlier benchmark's rows file (OUT.jsonl) whose baseline answers are the reference: the
    # summary adds each method's agreement with them (a Medusa-2 head against the original target)
    reference: str | None = None


@dataclass
class DraftModelConfig:
    """A separate small causal LM that drafts for the target (the original speculative decoding;
    transformers' assisted generation): it must share the target's tokenizer (the token -> id
    mapping) and drafts a chain or a tree (the tree settings) with its own KV cache."""

    # a Hub id or local directory of a transformers causal LM (or embedded:smollm2, a .gguf file);
    # null = no draft model. Set, infer.py drafts with it when no head is given, and the benchmark
    # runs the methods draft and assisted by default
    model: str | None = None
    # the draft's precision: target = the target's dtype; float32 | bfloat16 | float16
    dtype: str = "target"
    revision: str | None = None  # a Hub revision (branch, tag or commit) of draft.model
    trust_remote_code: bool = False  # let transformers run the draft model repo's own code
    # assisted (transformers generate with assistant_model): tokens the assistant drafts per step;
    # None = the draft method's depth (tree.depth, else 5)
    assistant_tokens: int | None = None
    # assisted: transformers' num_assistant_tokens_schedule: constant (transformers' default),
    # heuristic (+2 after a step that accepts every draft, -1 otherwise, kept across calls: the
    # benchmark resets it before each answer) or heuristic_transient
    assistant_schedule: str = "constant"


@dataclass
class LayerSkipConfig:
    """Self-speculative decoding without training (Draft & Verify, SWIFT): the target drafts with
    some of its decoder layers skipped (decode/layer_skip.py; the calibration: bench/layer_skip.py)."""

    # null = off; auto = the choice calibrated for this target on this machine (its layers, chain
    # depth and stop probability; calibrated and kept in its cache first when there is none); a list
    # of decoder layer indices = those skipped, drafting a chain of tree.depth (else 5) stopping under
    # tree.min_path_prob. Set, infer.py drafts with it when no head or draft model is given, and the
    # benchmark runs the method skip by default
    layers: Any = None
    recalibrate: bool = False  # auto: calibrate again (the new choice replaces the stored one if faster)
    max_share: float = 0.5  # auto: skip at most this share of the layers
    depth: int = 6  # auto: the deepest chain weighed
    # auto: the most ranks drafted per level (1 = a chain; w = the chain with the next w - 1 ranks
    # beside each of its nodes, decode/tree.spine_paths: drafted at a chain's cost, verified wider)
    width: int = 4
    # > 0: draft over the draft_vocab most frequent answer tokens of vocab_data, reading only their
    # LM-head rows per level; a target token outside them is never drafted (auto: stored with the choice)
    draft_vocab: int = 0
    # draft_vocab: the conversations its tokens are counted on (a file or directory train.py reads,
    # e.g. the target's own answers)
    vocab_data: str | None = None


@dataclass
class InferJobConfig:
    """infer.py: speculative decoding with a head, one prompt (the demo) or a benchmark."""

    head_path: str | None = None  # head=DIR_OR_HUB_ID on the command line
    # the target; null = the one named in the head's config.json (model=NAME: a conf/model option)
    model: ModelConfig | None = None
    tree: TreeConfig = field(default_factory=TreeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    draft: DraftModelConfig = field(default_factory=DraftModelConfig)  # a separate draft model (draft.model=...)
    skip: LayerSkipConfig = field(default_factory=LayerSkipConfig)  # the target drafting with layers skipped
    prompt: str | None = None  # the demo's prompt
    system: str | None = None  # an optional system message
    chat: bool = True  # apply the tokenizer's chat template to the prompt
    max_new_tokens: int = 256  # the demo's answer length, in tokens
    temperature: float = 0.0  # 0 = greedy (token for token the target's own greedy output)
    top_p: float = 1.0  # nucleus sampling, applied alike to the target and the drafts
    top_k: int = 0  # top-k sampling (0 = off), applied alike to the target and the drafts
    acceptance: str = "auto"  # auto (lossless) | typical (Medusa, lossy)
    typical_epsilon: float = 0.09  # typical: accept a token whose probability beats min(epsilon, alpha*exp(-H))
    typical_alpha: float = 0.3  # typical: alpha of that threshold (H: the target's entropy there)
    compare: bool = True  # demo: also run plain decoding, to report the speedup
    mark: str = "auto"  # how drafted and accepted tokens are shown: auto | ansi | brackets | none
    seed: int = 0  # seeds sampling
    device: str = "auto"  # auto | cpu | cuda
    # auto: on CPU, each linear layer of the target and head takes the kernel measured fastest on
    # this machine for the row count at hand (specheads.kernels.linear_layout), and masked attention keeps
    # grouped KV heads unrepeated (specheads.kernels.gqa_attention); stock: transformers as shipped
    linear_layout: str = "auto"
    # the precision the head drafts in: auto = int8 weights (one scale per output channel) with bf16
    # activations on a CPU with native bf16 when the target runs fp32 (a draft step reads the
    # head's weights from memory: a quarter of the bytes), else the target's dtype;
    # target | float32 | bfloat16 | float16 | int8 (int8 weights, activations as under auto).
    # Outputs are the target's either way.
    head_dtype: str = "auto"
    # load a head onto a target of its shape whose weights differ from those it was trained on
    # (another quantization or fine-tune; its acceptance will be lower); refused by default
    allow_target_mismatch: bool = False
    debug: bool = False  # full tracebacks instead of one-line errors


def parse_tree_spec(spec: str) -> TreeConfig:
    """One bench.trees entry as the tree settings it stands for:
    chain:K (the top-1 chain of K drafts), dynamic:DEPTH:TOP_K:NODES[:P] (EAGLE-2; P: the least
    path probability a node needs), static:PATHS (rank paths as JSON, e.g. static:[[0],[1],[0,0]])
    or default (the head's stored tree and depth gate)."""
    kind, _, rest = str(spec).partition(":")
    try:
        if kind == "default" and not rest:
            return TreeConfig(kind="default")
        if kind == "chain":
            return TreeConfig(kind="chain", depth=_positive(rest))
        if kind == "dynamic":
            depth, top_k, nodes, *floor = rest.split(":")
            if len(floor) > 1 or (floor and not 0.0 < float(floor[0]) < 1.0):
                raise ValueError(rest)
            return TreeConfig(
                kind="dynamic",
                depth=_positive(depth),
                top_k=_positive(top_k),
                total_tokens=_positive(nodes),
                min_path_prob=float(floor[0]) if floor else None,
            )
        if kind == "static":
            paths = json.loads(rest)
            if isinstance(paths, list) and paths and all(isinstance(p, list) for p in paths):
                return TreeConfig(kind="static", paths=paths)
    except ValueError:
        pass
    raise SpecHeadsError(
        f"bench.trees: {spec!r} is not a tree; use chain:K, dynamic:DEPTH:TOP_K:NODES[:P], "
        "static:[[0],[1],[0,0]] or default"
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def validate(settings: InferJobConfig) -> InferJobConfig:
    """The settings, checked (SpecHeadsError naming the bad key), with bench.output defaulted."""
    t, b = settings.tree, settings.bench
    if settings.linear_layout not in ("auto", "stock"):
        raise SpecHeadsError(f"linear_layout must be auto or stock, got {settings.linear_layout!r}")
    for name in ("min_path_prob", "hybrid_min_path_prob"):
        if getattr(t, name) is not None and not 0.0 <= getattr(t, name) < 1.0:
            raise SpecHeadsError(f"tree.{name} must be in [0, 1), got {getattr(t, name)}")
    check_draft_dtype(settings.head_dtype)
    if t.kind not in TREE_KINDS:
        raise SpecHeadsError(f"tree.kind must be one of {', '.join(TREE_KINDS)}, got {t.kind!r}")
    for name in ("depth", "top_k", "total_tokens", "max_nodes", "calibration_prompts", "calibration_tokens"):
        if getattr(t, name) is not None and getattr(t, name) < 1:  # None: resolve_search
            raise SpecHeadsError(f"tree.{name} must be >= 1, got {getattr(t, name)}")
    if t.ngram_max < 1 or (t.ngram_nodes is not None and t.ngram_nodes < 0):
        raise SpecHeadsError(f"need tree.ngram_max >= 1 and tree.ngram_nodes >= 0, got {t.ngram_max}, {t.ngram_nodes}")
    if t.text_alone is not None and t.text_alone < 0:
        raise SpecHeadsError(f"need tree.text_alone >= 0 (0: off), got {t.text_alone}")
    if t.text_source not in TEXT_SOURCES:
        raise SpecHeadsError(f"tree.text_source must be one of {', '.join(TEXT_SOURCES)}, got {t.text_source!r}")
    if t.hybrid_rule not in HYBRID_RULES:
        raise SpecHeadsError(f"tree.hybrid_rule must be one of {', '.join(HYBRID_RULES)}, got {t.hybrid_rule!r}")
    if t.suffix_match < 1 or t.suffix_history < 0:
        raise SpecHeadsError(
            f"need tree.suffix_match >= 1 and tree.suffix_history >= 0, got {t.suffix_match}, {t.suffix_history}"
        )
    trigger = ("tree.suffix_match", t.suffix_match) if t.text_source == "suffix" else ("tree.ngram_max", t.ngram_max)
    if t.text_alone_ngram is not None and not 1 <= t.text_alone_ngram <= trigger[1]:
        raise SpecHeadsError(
            f"need 1 <= tree.text_alone_ngram <= {trigger[0]} ({trigger[1]}), got {t.text_alone_ngram}"
        )
    if t.dynamic is not None and t.dynamic not in TREE_DYNAMIC:
        raise SpecHeadsError(f"tree.dynamic must be one of {', '.join(TREE_DYNAMIC)}, got {t.dynamic!r}")
    # true / false: the values of the boolean this key was before
    t.save = {"true": "cache", "false": "none"}.get(str(t.save).lower(), str(t.save))
    if t.save not in TREE_SAVES:
        raise SpecHeadsError(f"tree.save must be one of {', '.join(TREE_SAVES)}, got {t.save!r}")
    t.replace = {"true": "always", "false": "if_faster"}.get(str(t.replace).lower(), str(t.replace))
    if t.replace not in TREE_REPLACES:
        raise SpecHeadsError(f"tree.replace must be one of {', '.join(TREE_REPLACES)}, got {t.replace!r}")
    if b.mode not in BENCH_MODES:
        raise SpecHeadsError(f"bench.mode must be one of {', '.join(BENCH_MODES)}, got {b.mode!r}")
    if b.mode == "replay" and not b.questions:
        raise SpecHeadsError("bench.mode=replay replays heads on the answers to bench.questions=FILE.jsonl: give it")
    if b.mode == "replay" and settings.temperature > 0:
        raise SpecHeadsError("bench.mode=replay counts greedy decoding (temperature=0); the timed benchmark samples")
    if b.bandwidth_mib < 0:
        raise SpecHeadsError(f"bench.bandwidth_mib must be >= 0 (0: off), got {b.bandwidth_mib}")
    if b.turns not in ("first", "all"):
        raise SpecHeadsError(f"bench.turns must be first or all, got {b.turns!r}")
    d = settings.draft
    if d.dtype not in DRAFT_MODEL_DTYPES:
        raise SpecHeadsError(f"draft.dtype must be one of {', '.join(DRAFT_MODEL_DTYPES)}, got {d.dtype!r}")
    if d.assistant_tokens is not None and d.assistant_tokens < 1:
        raise SpecHeadsError(
            f"draft.assistant_tokens must be >= 1 (or null: the draft's depth), got {d.assistant_tokens}"
        )
    if d.assistant_schedule not in ASSISTANT_SCHEDULES:
        raise SpecHeadsError(
            f"draft.assistant_schedule must be one of {', '.join(ASSISTANT_SCHEDULES)}, got {d.assistant_schedule!r}"
        )
    k = settings.skip
    if isinstance(k.layers, str) and k.layers != "auto":
        raise SpecHeadsError(f"skip.layers must be auto or a list of decoder layer indices, got {k.layers!r}")
    if not isinstance(k.layers, (str, type(None))) and (
        not isinstance(k.layers, (list, tuple))
        or not k.layers
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in k.layers)
    ):
        raise SpecHeadsError(f"skip.layers must be auto or a non-empty list of decoder layer indices, got {k.layers!r}")
    if not 0 < k.max_share < 1:
        raise SpecHeadsError(f"skip.max_share must be in (0, 1), got {k.max_share}")
    if k.depth < 1:
        raise SpecHeadsError(f"skip.depth must be >= 1, got {k.depth}")
    if k.width < 1:
        raise SpecHeadsError(f"skip.width must be >= 1, got {k.width}")
    if k.draft_vocab < 0:
        raise SpecHeadsError(f"skip.draft_vocab must be 0 (every token) or a token count, got {k.draft_vocab}")
    if k.draft_vocab and not k.vocab_data:
        raise SpecHeadsError(
            "skip.draft_vocab counts the answer tokens of skip.vocab_data: give a conversation file or directory"
        )
    skipping = k.layers is not None
    if (d.model or skipping) and list(b.methods) == list(DEFAULT_METHODS):  # the methods left as they are
        kept = [m for m in DEFAULT_METHODS if settings.head_path or m not in HEAD_METHODS]
        b.methods = kept + (list(DRAFT_MODEL_METHODS) if d.model else []) + (["skip"] if skipping else [])
    if "skip" in b.methods and not skipping:
        raise SpecHeadsError(
            "bench.methods [skip] drafts with the target's layers skipped: give skip.layers=auto or a list"
        )
    needs_draft = [m for m in b.methods if m in DRAFT_MODEL_METHODS]
    if needs_draft and not d.model:
        raise SpecHeadsError(f"bench.methods {needs_draft} draft with a separate model: give draft.model=NAME_OR_DIR")
    if d.model and d.model.startswith((".", "/", "~")) and not Path(d.model).expanduser().exists():
        raise SpecHeadsError(f"draft.model {d.model} does not exist")
    if d.model and not settings.head_path and t.kind == "auto":
        raise SpecHeadsError(
            "tree=auto calibrates a head's tree: a draft model drafts tree=chain (the default, tree.depth "
            "tokens), static or dynamic"
        )
    bad = [m for m in b.methods if m not in METHODS]
    if bad or not b.methods:
        raise SpecHeadsError(f"bench.methods must be a non-empty subset of {list(METHODS)}, got {b.methods}")
    if len(set(b.methods)) != len(b.methods):
        raise SpecHeadsError(f"bench.methods repeats a method: {b.methods}")
    if b.max_new_tokens < 1 or settings.max_new_tokens < 1:
        raise SpecHeadsError("max_new_tokens must be >= 1")
    if settings.temperature < 0 or not 0 < settings.top_p <= 1 or settings.top_k < 0:
        raise SpecHeadsError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
    if settings.acceptance not in ("auto", "typical"):
        raise SpecHeadsError(f"acceptance must be auto (lossless) or typical (lossy), got {settings.acceptance!r}")
    if settings.acceptance == "typical" and settings.temperature <= 0:
        raise SpecHeadsError("acceptance=typical needs temperature > 0")
    if settings.mark not in ("auto", "ansi", "brackets", "none"):
        raise SpecHeadsError(f"mark must be auto, ansi, brackets or none, got {settings.mark!r}")
    if b.output and not b.questions:
        raise SpecHeadsError("bench.output is set but bench.questions=FILE.jsonl is not")
    if b.questions and not b.output:
        b.output = str(Path(DEFAULT_BENCH_DIR) / f"{Path(b.questions).stem}.jsonl")
    for extra in b.heads:
        if extra.startswith((".", "/", "~")) and not Path(extra).expanduser().exists():
            raise SpecHeadsError(f"bench.heads: {extra} does not exist")
    if b.heads and not b.questions:
        raise SpecHeadsError("bench.heads compares heads in the benchmark: give bench.questions=FILE.jsonl")
    for name in b.head_dtypes:
        check_draft_dtype(name, "bench.head_dtypes: each")
    if b.head_dtypes and (not b.questions or "spec" not in b.methods or not settings.head_path):
        raise SpecHeadsError(
            "bench.head_dtypes runs the head in other precisions beside method spec: give head=DIR, "
            "bench.questions=FILE.jsonl and keep spec in bench.methods"
        )
    if len(set(b.head_dtypes)) != len(b.head_dtypes):
        raise SpecHeadsError("bench.head_dtypes names a precision twice")
    for spec in b.trees:
        parse_tree_spec(spec)
    if b.trees and (not b.questions or not settings.head_path or b.mode != "timed"):
        raise SpecHeadsError(
            "bench.trees times the head with other trees beside its own: give head=DIR and "
            "bench.questions=FILE.jsonl (timed mode; bench.mode=replay already counts every static tree)"
        )
    if len(set(b.trees)) != len(b.trees):
        raise SpecHeadsError("bench.trees names a tree twice")
    if not settings.head_path and ((not b.questions and not d.model and not skipping) or "spec" in b.methods):
        raise SpecHeadsError(
            "give the draft head: head=DIR_OR_HUB_ID (or a separate draft model: draft.model=..., or the "
            "target's own layers: skip.layers=auto)"
        )
    if skipping and not settings.head_path and t.kind == "auto":
        raise SpecHeadsError("tree=auto calibrates a head's tree: skip.layers=auto calibrates the layer skip itself")
    if not settings.head_path and settings.model is None:
        raise SpecHeadsError("without a head, give the target: model=NAME")
    if not b.questions and not settings.prompt:
        raise SpecHeadsError('give a prompt (prompt="...") or a benchmark (bench.questions=... bench.output=...)')
    if b.questions and named_as_local(b.questions) and not Path(b.questions).expanduser().exists():
        raise SpecHeadsError(f"questions file {b.questions} does not exist")  # a Hub id is checked where it is read
    head = settings.head_path
    if head and head.startswith((".", "/", "~")) and not Path(head).expanduser().exists():
        # checked here, before torch is imported, so that a typo fails at once
        raise SpecHeadsError(f"head {head} does not exist")
    return settings


# a question set named by a data file's suffix is a local file: specheads.data.formats.DATA_FILE_SUFFIXES,
# which this layer cannot import (tests/config/test_infer_schema.py holds the two equal)
QUESTION_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


def named_as_local(source: str) -> bool:
    """A question set written as a local path (./, /, ~, a data file's suffix, or no NAME/SET form of
    a Hub id), which must then exist before anything loads."""
    return (
        source.startswith((".", "/", "~")) or source.lower().endswith(QUESTION_FILE_SUFFIXES) or source.count("/") != 1
    )
