"""bench.mode=replay: what greedy speculative decoding accepts on a question set, without decoding.

Under greedy verification the output is the target's own greedy answer whatever the head drafts,
so a run is fixed by one number per step: how many drafted tokens the tree accepts. Teacher-forced
rank vectors give that number at every answer position: the head drafts along the true answer
(exactly as a tree drafts along its correct path) and the rank of each true token at depths
1..D is recorded; a tree accepts the longest prefix of that vector that is one of its paths.
`replay` then walks the answer as `speculative_generate` does (root token i, k drafts accepted,
the bonus token i+k+1 is the next root: walk.walk, the walk tree=auto's scorers take too), so its
count of target forwards is the real loop's, for a chain of K or any static tree, at the cost of
one target forward per answer (plus the head's).

That makes it the measure to choose heads, checkpoints and recipes by: tau of every chain length
and tree size, per category, in seconds once the target's greedy answers are written (they are
kept beside the output and reused while the target, prompts and token limit are unchanged).
Timing is not replayed: the timed benchmark (bench.mode=timed) measures speed.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from ..atomic import write_json, write_jsonl
from ..config.infer import InferJobConfig
from ..decode.baselines import PlainDrafter
from ..decode.generate import speculative_generate
from ..decode.tree import chain_paths
from ..errors import SpecHeadsError
from ..export import open_head, resolve_head_path
from ..heads.io import draft_precision
from ..target import eos_token_ids, target_identity
from .compared import head_label
from .inputs import encode_turns, sampling_config
from .questions import read_questions
from .record import results_record
from .runner import output_paths
from .trees import machine_record
from .walk import walk

MISS = 1 << 30  # the rank of a true token outside a reduced draft vocabulary
CHAINS = (1, 2, 3, 4, 5, 6, 7, 8)  # vLLM serves chains up to num_speculative_tokens; K = 2..8 is the range compared
TREE_NODES = (1, 3, 5, 8, 12, 16)


@torch.no_grad()
def rank_vectors(
    target, head, ids: Sequence[int], answer_start: int, depth: int, top_probs: list | None = None
) -> list[tuple[int, ...]]:
    """For each answer position, the rank (0 = top-1) of each true next token at depths 1..depth.

    vectors[i] is rooted at answer token i (ids[answer_start + i]) and ranks the tokens after it;
    an answer of n tokens has n - 1 of them (its last token roots no draft). With `top_probs` (a
    list), the head's top-1 probability at each depth along the same true path is appended to it
    per position, at every depth the answer reaches (a miss included): what a tree's depth gate
    (StaticTree.min_path_prob) reads where the drafts were right."""
    seq = torch.tensor([list(ids)], device=target.device)
    with target.capture(head.target_layer_ids(), final=head.reads_final) as store:
        target.model(seq)
    full = list(ids)
    # per depth d: [T, Vd], position t drafting token t+1+d along the true sequence
    per_depth = [x[0] for x in head.teacher_forced_logits(seq, dict(store), depth)]
    # target ids -> draft ids (-1: outside a reduced draft vocabulary)
    to_draft = torch.full((target.info.vocab_size,), -1, dtype=torch.long, device=seq.device)
    draft_ids = torch.arange(per_depth[0].shape[-1], device=seq.device)
    to_draft[head.draft_to_target(draft_ids)] = draft_ids
    vectors = []
    if top_probs is not None:
        tops = [torch.softmax(x.float(), dim=-1).amax(-1).tolist() for x in per_depth]
    for t in range(answer_start - 1, len(full) - 2):  # tree rooted at token t+1
        if top_probs is not None:
            top_probs.append(tuple(top[t] for d, top in enumerate(tops, start=1) if t + 1 + d < len(full)))
        ranks = []
        for d, logits in enumerate(per_depth, start=1):
            if t + 1 + d >= len(full):
                break
            true = int(to_draft[full[t + 1 + d]])
            if true < 0:
                ranks.append(MISS)
                break
            rank = int((logits[t] > logits[t, true]).sum())
            ranks.append(rank)
        vectors.append(tuple(ranks))
    return vectors


def outside_draft_vocab(vectors: Sequence[tuple[int, ...]]) -> float:
    """The share of answer positions whose next token lies outside the head's draft vocabulary
    (first rank MISS): positions no draft of this head can be accepted at, whatever it learnt."""
    rooted = [v for v in vectors if v]
    return sum(v[0] == MISS for v in rooted) / len(rooted) if rooted else 0.0


def accepted_length(vector: Sequence[int], tree: frozenset, cap: int) -> int:
    """Drafts a prefix-closed tree accepts at a root with this rank vector: the longest prefix
    of the vector that is a path of the tree, at most `cap` deep."""
    k = 0
    while k < min(len(vector), cap) and tuple(vector[: k + 1]) in tree:
        k += 1
    return k


@dataclass(frozen=True)
class Replay:
    """One answer decoded by a tree, as counted by speculative_generate."""

    forwards: int  # decode-phase target forwards (the prefill is not counted)
    tokens: int  # the tokens they made: the answer less the prefill's token
    accepted: tuple[int, ...]  # drafted tokens accepted at each step


def replay(
    vectors: Sequence[Sequence[int]], paths: Sequence[Sequence[int]], answer_len: int, max_new_tokens: int
) -> Replay:
    """Walk a greedy answer of answer_len tokens step by step as the loop would with this tree."""
    tree = frozenset(tuple(p) for p in paths)
    if len(vectors) < answer_len - 1:
        raise ValueError(f"{len(vectors)} rank vectors cannot replay an answer of {answer_len} tokens")
    accepted: list[int] = []

    def step(i: int) -> int:  # answer token i is the root; the prefill made token 0
        cap = max_new_tokens - (i + 1) - 1  # the loop's max_depth: the tokens still allowed, less the bonus
        accepted.append(accepted_length(vectors[i], tree, cap))
        return accepted[-1]

    walk([max(answer_len - 1, 0)], step)
    return Replay(len(accepted), max(answer_len - 1, 0), tuple(accepted))


def tau(replays: Sequence[Replay]) -> float:
    """Tokens per decode forward over a set of answers (the timed benchmark's tau of a run)."""
    forwards = sum(r.forwards for r in replays)
    return sum(r.tokens for r in replays) / forwards if forwards else 1.0


def acceptance_per_depth(replays: Sequence[Replay], depth: int) -> list[float]:
    """P(the draft at depth d is accepted | the step's path reached depth d - 1), d = 1..depth."""
    steps = [k for r in replays for k in r.accepted]
    out = []
    for d in range(1, depth + 1):
        reached = sum(k >= d - 1 for k in steps)
        out.append(sum(k >= d for k in steps) / reached if reached else 0.0)
    return out


def path_frequencies(vectors: Sequence[tuple[int, ...]], top_k: int) -> Counter:
    """How many roots accept each path of ranks (each within top_k), over these rank vectors."""
    freq: Counter = Counter()
    for v in vectors:
        for m in range(1, len(v) + 1):
            if v[m - 1] >= top_k:
                break
            freq[v[:m]] += 1
    return freq


def best_paths(freq: Counter, n: int) -> list[list[int]]:
    """The n most frequent paths; ties favour shallow, then low ranks (keeps every prefix).
    A head whose drafts were never right still gets the smallest tree, [[0]]."""
    ordered = sorted(freq, key=lambda p: (-freq[p], len(p), p))
    return [list(p) for p in ordered[:n]] or [[0]]


# -- the target's greedy answers ---------------------------------------------------------------------


def answer_key(identity: dict, kernels: str, prompt_ids: Sequence[int], max_new_tokens: int) -> str:
    """What an answer depends on: the target's weights and how they run, the prompt, the limit."""
    blob = json.dumps(
        [identity.get("weights_sha256"), identity.get("loaded_as"), kernels, list(prompt_ids), max_new_tokens]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def greedy_answers(target, questions: list[dict], settings: InferJobConfig, path: Path) -> list[dict]:
    """The target's greedy answer to every turn asked (a later turn after the target's own earlier
    answers), through our own plain loop; rows of `path` with the same key are reused."""
    b = settings.bench
    earlier: list[dict] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                row["answer_ids"] = [int(t) for t in row["answer_ids"]]
                earlier.append(row)
            except (ValueError, KeyError, TypeError):
                raise SpecHeadsError(f"{path} is not a replay answers file: remove it to write it anew") from None
    known = {row["key"]: row["answer_ids"] for row in earlier}
    identity = target_identity(target)
    cfg = sampling_config(settings, b.max_new_tokens, eos_token_ids(target))
    cfg.temperature = 0.0
    tok = target.tokenizer
    rows: list[dict] = []
    for q in tqdm(questions, desc="replay: greedy answers", unit="question", file=sys.stderr, dynamic_ncols=True):
        turns = q["turns"] if b.turns == "all" else q["turns"][:1]
        texts: list[str] = []
        generated = False
        for turn in range(1, len(turns) + 1):
            ids = encode_turns(tok, turns[:turn], texts, settings.system, settings.chat)
            key = answer_key(identity, settings.linear_layout, ids, b.max_new_tokens)
            if key not in known:
                prompt = torch.tensor([ids], device=target.device)
                known[key] = speculative_generate(target, PlainDrafter(), prompt, cfg).output_ids
                generated = True
            answer = known[key]
            texts.append(tok.decode(answer, skip_special_tokens=True))
            rows.append(
                {
                    "key": key,
                    "question_id": q["question_id"],
                    "category": q["category"],
                    "turn": turn,
                    "prompt_ids": ids,
                    "answer_ids": answer,
                }
            )
        if generated:  # kept as it grows: an interrupted run resumes from it
            keep(path, rows, earlier)
    keep(path, rows, earlier)
    return rows


def keep(path: Path, rows: list[dict], earlier: list[dict]) -> None:
    """This run's answers, then the file's earlier ones this run did not ask (another subset of the
    questions, another turn setting): one file serves every run of the same output."""
    asked = {r["key"] for r in rows}
    write_jsonl(path, rows + [r for r in earlier if r["key"] not in asked])


# -- the report ------------------------------------------------------------------------------------


def tree_of(head, settings: InferJobConfig, main: bool) -> list[list[int]] | None:
    """The static tree infer.py runs for this head: tree.paths for the main head under
    tree=static or tree=auto, else the head's stored tree (or this machine's cached one)."""
    if main and settings.tree.kind == "static" and settings.tree.paths:
        return [list(p) for p in settings.tree.paths]
    stored = getattr(head, "default_tree", None)
    return [list(p) for p in stored] if stored else None


def replay_head(head, target, answers: list[dict], tree: list[list[int]] | None, max_new_tokens: int) -> dict:
    depth = max([max(CHAINS), *(len(p) for p in tree or [])])
    vectors = []
    for row in tqdm(answers, desc=f"replay: {head.family} ranks", unit="answer", file=sys.stderr, leave=False):
        vectors.append(rank_vectors(target, head, row["prompt_ids"] + row["answer_ids"], len(row["prompt_ids"]), depth))

    def run(paths):  # one Replay per answer, in the answers' order
        return [replay(v, paths, len(a["answer_ids"]), max_new_tokens) for v, a in zip(vectors, answers)]

    freq = path_frequencies([v for vs in vectors for v in vs], top_k=8)
    chains = {k: run(chain_paths(k)) for k in CHAINS}
    report: dict[str, Any] = {
        "positions": sum(len(vs) for vs in vectors),
        "outside_draft_vocab": round(outside_draft_vocab([v for vs in vectors for v in vs]), 4),
        "chain_tau": {str(k): round(tau(r), 4) for k, r in chains.items()},
        "acceptance_per_depth": [round(x, 4) for x in acceptance_per_depth(chains[max(CHAINS)], max(CHAINS))],
        # the n paths most often right on these very answers: a bound for a tree of n nodes,
        # flattering (chosen on what it is measured on), comparable across heads
        "best_tree_tau": {str(n): round(tau(run(best_paths(freq, n))), 4) for n in TREE_NODES},
        "tree": None,
    }
    own = run(tree) if tree else None
    if own is not None:
        report["tree"] = {"paths": tree, "nodes": len(tree), "tau": round(tau(own), 4)}
    if head.training_record:
        report["trained"] = trained(head.training_record)
    categories: dict[str, list[int]] = {}
    for i, row in enumerate(answers):
        categories.setdefault(row["category"], []).append(i)
    report["per_category"] = {
        c: {
            "chain_3_tau": round(tau([chains[3][i] for i in rows]), 4),
            "outside_draft_vocab": round(outside_draft_vocab([v for i in rows for v in vectors[i]]), 4),
            **({"tree_tau": round(tau([own[i] for i in rows]), 4)} if own is not None else {}),
        }
        for c, rows in categories.items()
    }
    return report


def trained(record: dict) -> dict:
    """How much a head had read when it was written: steps and rows (steps x batch x accumulation x
    ranks), with the run's command, which every checkpoint of one run shares."""
    steps = int(record.get("steps") or 0)
    per_step = (
        int(record.get("batch_size") or 0) * int(record.get("grad_accum") or 1) * int(record.get("world_size") or 1)
    )
    return {"steps": steps, "rows_read": steps * per_step, "command": record.get("command")}


def training_curves(heads: dict[str, dict]) -> dict[str, list[tuple[int, float, float]]]:
    """The benchmark's acceptance against training: the heads that record their run, grouped by
    its command (the checkpoints of one run), each group as (rows read, chain of 3 tau, best 5-node
    tree tau) by rows read and named after its last head. Groups of one head are kept: a point."""
    runs: dict[str, list[tuple[str, dict]]] = {}
    for label, r in heads.items():
        if r.get("trained") and r["trained"]["rows_read"] > 0:
            runs.setdefault(str(r["trained"]["command"]), []).append((label, r))
    curves = {}
    for members in runs.values():
        members.sort(key=lambda m: m[1]["trained"]["rows_read"])
        curves[members[-1][0]] = [
            (r["trained"]["rows_read"], r["chain_tau"]["3"], r["best_tree_tau"]["5"]) for _, r in members
        ]
    return curves


def format_replay(heads: dict[str, dict]) -> str:
    chain = " ".join(f"{'K=' + k:>6}" for k in map(str, CHAINS))
    lines = [f"{'head':<24} {'tree':>11} {chain}   best n-node tree tau ({', '.join(map(str, TREE_NODES))})"]
    for label, r in heads.items():
        t = r["tree"]
        tree = f"{t['tau']:.3f} ({t['nodes']})" if t else "-"
        lines.append(
            f"{label[:24]:<24} {tree:>11} "
            + " ".join(f"{r['chain_tau'][str(k)]:>6.3f}" for k in CHAINS)
            + "   "
            + " ".join(f"{r['best_tree_tau'][str(n)]:.3f}" for n in TREE_NODES)
        )
    return "\n".join(lines)


def run_replay(settings: InferJobConfig, session, out: TextIO = sys.stdout) -> dict:
    """bench.mode=replay: the head and every bench.heads head replayed on the target's greedy answers.

    The target's greedy answers are written once (OUT.greedy.jsonl, reused while the target,
    prompts and token limit stay the same); each head drafts along them teacher-forced, and every
    step of greedy speculative decoding is replayed from the rank of each true token.

    Args:
        settings: infer.py's validated settings, with bench.questions set.
        session: the loaded target and head (specheads.bench.session.load_session).
        out: where the table is printed.

    Returns:
        The report written to OUT.replay.json: each head's exact tau for chains of 1-8 drafts, its
        own tree and the best trees of 1-16 nodes, overall and per category.
    """
    b = settings.bench
    target = session.target
    questions = read_questions(b.questions, b.limit, b.per_category, b.categories)
    paths = output_paths(b.output)
    paths["replay"].parent.mkdir(parents=True, exist_ok=True)
    heads: dict[str, tuple[Any, list[list[int]] | None, str]] = {}
    if session.head is not None:
        label = head_label(session.head_dir) if session.head_dir else "head"
        heads[label] = (session.head, tree_of(session.head, settings, main=True), str(session.head_dir))
    for path in b.heads:
        label = head_label(path)
        if label in heads:
            raise SpecHeadsError(f"bench.heads: two heads are named {label!r}; give them distinct directory names")
        head = open_head(resolve_head_path(path), target, session.allow_target_mismatch)
        # ranks of near-ties move with the arithmetic: two heads are compared on the same one
        session.draft_like_own_head(head)
        heads[label] = (head, tree_of(head, settings, main=False), path)
    answers = greedy_answers(target, questions, settings, paths["answers"])
    results = {}
    for label, (head, tree, path) in heads.items():
        results[label] = {
            "head": path,
            "head_dtype": draft_precision(head),
            **replay_head(head, target, answers, tree, b.max_new_tokens),
        }
    report = {
        "mode": "replay",
        "target": target.info.name,
        "device": str(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "questions": len(questions),
        "turns": b.turns,
        "answers": len(answers),
        "answer_tokens": sum(len(r["answer_ids"]) for r in answers),
        "max_new_tokens": b.max_new_tokens,
        "heads": results,
    }
    ran = {label: path for label, (_, _, path) in heads.items()}
    machine = machine_record(target.device, kernels=session.layouts is not None)
    report["record"] = results_record("replay", ran, b.questions, len(questions), machine)
    write_json(paths["replay"], report)
    if b.plots:
        from .plots import plot_replay, plot_replay_training

        plot_replay(results, paths["replay_png"])
        curves = training_curves(results)
        if sum(len(c) for c in curves.values()) > 1:  # something to compare along training
            plot_replay_training(curves, paths["replay_training_png"])
    out.write(
        f"replay of greedy speculative decoding: {len(answers)} answers, {report['answer_tokens']} tokens "
        f"(tau = tokens per target forward, as the timed benchmark counts it)\n"
    )
    out.write(format_replay(results) + "\n")
    out.write(f"answers: {paths['answers']}\nreport: {paths['replay']}\n")
    out.flush()
    return report
