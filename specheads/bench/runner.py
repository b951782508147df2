"""Benchmark harness (docs/contracts.md): FastChat questions, methods interleaved per question in
one process, one JSON row per (question, method), a summary per method and category.

Methods: baseline = the target's own decoding with transformers `generate`; plain = plain decoding
through this package's own loop and forward path (no drafts); prompt_lookup = transformers' prompt
lookup decoding; lookup = prompt lookup through this package's own loop (the text's repeats alone,
bench.prompt_lookup_num_tokens nodes, n-grams up to tree.ngram_max, as hybrid drafts them without a
head); spec = this package's tree speculative decoding; hybrid = the head's tree and the
continuations of the text's own repeats merged into one tree (decode.drafters.HybridDrafter; prompt
lookup through this package's loop when there is no head), with the share of accepted tokens that
came from each source; draft = a separate draft model (draft.model) drafting a chain or tree through
this package's loop (decode.draft_model); assisted = transformers' assisted generation with the same
draft model (`assistant_model`); skip = the target drafting for itself with decoder layers skipped
(skip.layers; decode.layer_skip).
Conventions: target_forwards counts decode-phase forwards (prefill excluded); tau = tokens
produced by decode forwards / decode forwards (1.0 for plain decoding); speedup = tokens/s over
baseline tokens/s on the same questions; overhead c = tau / speedup - 1.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from ..atomic import write_json
from ..config.infer import InferJobConfig
from ..decode.baselines import Assistant, PlainDrafter, hf_generate
from ..decode.generate import SamplingConfig, speculative_generate, tau_of
from ..decode.policy import DraftPlan, describe_policy, plan_drafts, policy_depth
from ..heads.io import draft_precision
from ..target import eos_token_ids
from .bandwidth import BandwidthProbe, format_bandwidth, summarize_bandwidth
from .compared import open_compared_heads, open_precision_variants, open_tree_variants
from .inputs import encode_prompt, encode_turns, sampling_config
from .quality import agreement, format_agreement, read_reference, repeat_rate
from .questions import read_questions
from .record import results_record
from .session import method_drafter
from .trees import machine_record, warn_overlap

SPEC_FIELDS = ("accept_lengths", "accepted_drafts", "tree_depths", "tree_sizes")


def run_spec(target, drafter, prompt: torch.Tensor, cfg: SamplingConfig, generator=None) -> dict:
    res = speculative_generate(target, drafter, prompt, cfg, generator=generator)
    row = {
        "output_ids": res.output_ids,
        "target_forwards": res.target_forwards,
        "wall_s": res.wall_s,
        "prefill_s": res.prefill_s,
        "draft_s": res.draft_s,
        "verify_s": res.verify_s,
        "stopped_by": res.stopped_by,
    }
    row.update({k: getattr(res, k) for k in SPEC_FIELDS})
    if getattr(drafter, "sources", None) is not None:
        row["accepted_sources"] = res.accepted_sources
    return row


def source_shares(rows: Sequence[dict]) -> dict | None:
    """The share of accepted drafted tokens proposed by the head only, the text only, or both."""
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        for k, v in (r.get("accepted_sources") or {}).items():
            counts[k] += v
    total = sum(counts.values())
    if not any("accepted_sources" in r for r in rows):
        return None
    return {k: (counts[k] / total if total else 0.0) for k in ("head", "text", "both")} | {"accepted": total}


def format_shares(s: dict) -> str:
    return (
        f"accepted drafts {s['accepted']}: {s['head']:.0%} from the head, {s['text']:.0%} from the text, "
        f"{s['both']:.0%} from both"
    )


def _stats(rows: Sequence[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    forwards = sum(r["target_forwards"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    return {
        "questions": len(rows),
        "new_tokens": tokens,
        "target_forwards": forwards,
        "wall_s": wall,
        "tau": tau_of(tokens, forwards, answers=len(rows)),
        "tokens_per_s": tokens / wall if wall else 0.0,
    }


def summarize(rows: Sequence[dict], methods: Sequence[str]) -> dict:
    """Per method and category (plus "all"): tau, tokens/s, speedups, overhead c, repeated 4-grams."""
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for r in rows:
        groups[r["method"], "all"].append(r)
        groups[r["method"], r["category"]].append(r)
    categories = ["all"] + sorted({r["category"] for r in rows} - {"all"})
    out: dict[str, dict] = {}
    for m in methods:
        out[m] = {}
        for c in categories:
            if (m, c) in groups:
                out[m][c] = _stats(groups[m, c])
                out[m][c]["repeat_rate"] = repeat_rate([r["output_ids"] for r in groups[m, c]])
    for m in methods:
        for c, s in out[m].items():
            for ref in ("baseline", "plain", "prompt_lookup"):
                base = out.get(ref, {}).get(c)
                key = f"speedup_vs_{ref}"
                s[key] = s["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None
            sp = s["speedup_vs_baseline"]
            s["overhead_c"] = s["tau"] / sp - 1 if sp else None
    return out


def acceptance_per_depth(rows: Sequence[dict]) -> list[float]:
    """P(draft at depth d accepted | depths < d accepted and the tree reached depth d)."""
    reached, accepted = defaultdict(int), defaultdict(int)
    for r in rows:
        for n, depth in zip(r.get("accepted_drafts", []), r.get("tree_depths", [])):
            for d in range(1, depth + 1):
                if n >= d - 1:
                    reached[d] += 1
                    accepted[d] += n >= d
    return [accepted[d] / reached[d] for d in sorted(reached) if reached[d]]


def cost_breakdown(rows: Sequence[dict], method: str = "spec") -> dict | None:
    """Where a speculative step's time goes (for `method`), against one plain decoding step.

    speedup = tau * base_step / (draft + verify), so the three terms are the head's acceptance
    (tau), the drafting cost and the cost of verifying a whole tree instead of one token. The
    tau needed to break even is (draft + verify) / base_step.
    """
    spec = [r for r in rows if r["method"] == method and r["target_forwards"]]
    base = [r for r in rows if r["method"] == "baseline" and r["target_forwards"]]
    own = [r for r in rows if r["method"] == "plain" and r["target_forwards"]]
    if not spec or not (base or own):
        return None
    stats = _stats(spec)
    steps = stats["target_forwards"]
    draft = sum(r["draft_s"] for r in spec) / steps
    verify = sum(r["verify_s"] for r in spec) / steps
    # a plain step: everything after the prefill, per decode forward (the prefill is timed apart
    # for spec; for the baseline its share is removed using spec's prefill of the same prompts)
    prefill = {(r["question_id"], r.get("turn", 1)): r["prefill_s"] for r in spec}
    base_step = (
        sum(r["wall_s"] - prefill.get((r["question_id"], r.get("turn", 1)), 0.0) for r in base)
        / sum(r["target_forwards"] for r in base)
        if base
        else None
    )
    sizes = [n for r in spec for n in r.get("tree_sizes", [])]
    own_step = sum(r["wall_s"] - r["prefill_s"] for r in own) / sum(r["target_forwards"] for r in own) if own else None
    step = base_step or own_step  # a run without the HF baseline prices the step against our own loop's
    return {
        "plain_step_ms": 1e3 * base_step if base_step else None,
        "own_plain_step_ms": 1e3 * own_step if own_step else None,
        "draft_ms": 1e3 * draft,
        "verify_ms": 1e3 * verify,
        "mean_tree_nodes": sum(sizes) / len(sizes) if sizes else None,
        "verify_over_plain": verify / step,
        "draft_over_plain": draft / step,
        "tau": stats["tau"],
        "break_even_tau": (draft + verify) / step,
        # against this package's own plain step: what speculation must earn once the kernels are shared
        "break_even_tau_vs_own_plain": (draft + verify) / own_step if own_step else None,
    }


def format_costs(c: dict) -> str:
    step = f"({c['mean_tree_nodes']:.1f} tree nodes)" if c.get("mean_tree_nodes") is not None else "(no tree)"
    head = f"spec step: draft {c['draft_ms']:.1f} ms + verify {c['verify_ms']:.1f} ms {step}"
    if c.get("plain_step_ms") is None:  # no HF baseline in the run: our own loop's step is the plain one
        return (
            f"{head} vs own loop's plain step {c['own_plain_step_ms']:.1f} ms; "
            f"tau {c['tau']:.2f}, break-even tau {c['break_even_tau']:.2f} (vs own loop)"
        )
    return (
        f"{head} vs plain step {c['plain_step_ms']:.1f} ms"
        + (f" (own loop {c['own_plain_step_ms']:.1f} ms)" if c.get("own_plain_step_ms") else "")
        + "; "
        f"tau {c['tau']:.2f}, break-even tau {c['break_even_tau']:.2f}"
        + (f" ({c['break_even_tau_vs_own_plain']:.2f} vs own loop)" if c.get("break_even_tau_vs_own_plain") else "")
    )


def first_divergence(target, prompt_ids: list[int], base: list[int], other: list[int]) -> dict | None:
    """Where `other` leaves the baseline, and the target's top-2 logit margin there."""
    if base == other:
        return None
    i = next((k for k, (a, b) in enumerate(zip(base, other)) if a != b), min(len(base), len(other)))
    info = {
        "index": i,
        "baseline_token": base[i] if i < len(base) else None,
        "other_token": other[i] if i < len(other) else None,
        "top2_margin": None,
    }
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + base[:i]], device=target.device)
        logits = target.model(ids, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    info["top2_margin"] = float(top[0] - top[1])
    return info


def format_table(summary: dict) -> str:
    w = max([14, *(len(m) for m in summary)])
    head = (
        f"{'method':<{w}} {'category':<12} {'n':>4} {'tokens':>7} {'tau':>6} {'tok/s':>8} "
        f"{'vs base':>8} {'vs plain':>8} {'vs pld':>8} {'c':>7} {'rep4':>5}"
    )
    lines = [head, "-" * len(head)]

    def num(x, fmt, width):  # a column whose reference method did not run reads "-"
        return format(x, fmt) if x is not None else "-".rjust(width)

    for m, cats in summary.items():
        for c, s in cats.items():
            ratios = " ".join(
                num(s[f"speedup_vs_{ref}"], ">7.2f", 7) + ("x" if s[f"speedup_vs_{ref}"] is not None else " ")
                for ref in ("baseline", "plain", "prompt_lookup")
            )
            lines.append(
                f"{m:<{w}} {c[:12]:<12} {s['questions']:>4} {s['new_tokens']:>7} {s['tau']:>6.2f} "
                f"{s['tokens_per_s']:>8.1f} {ratios} {num(s['overhead_c'], '>7.2f', 7)} "
                f"{num(s.get('repeat_rate'), '>5.0%', 5)}"
            )
    return "\n".join(lines)


def output_paths(output: str | os.PathLike) -> dict[str, Path]:
    out = Path(output)
    stem = out.with_suffix("") if out.suffix == ".jsonl" else out
    return {
        "rows": out,
        "summary": Path(f"{stem}.summary.json"),
        "tau_png": Path(f"{stem}.tau.png"),
        "acceptance_png": Path(f"{stem}.acceptance.png"),
        # bench.mode=replay (specheads.bench.replay)
        "answers": Path(f"{stem}.greedy.jsonl"),
        "replay": Path(f"{stem}.replay.json"),
        "replay_png": Path(f"{stem}.replay.png"),
        "replay_training_png": Path(f"{stem}.replay_training.png"),
    }


# the methods drafting through this package's loop, their drafters built in this order (session.method_drafter)
DRAFTING_METHODS = ("spec", "hybrid", "lookup", "suffix", "draft", "skip")


def run_benchmark(settings: InferJobConfig, session, out: TextIO = sys.stdout) -> dict:
    """The timed benchmark of `infer.py bench.questions=FILE`: every method on every question.

    The methods of `bench.methods` (and `bench.heads`, `bench.head_dtypes`, `bench.trees` beside
    them) run interleaved per question; every output is compared with HF greedy's.

    Args:
        settings: infer.py's validated settings (specheads.config.infer.validate).
        session: the loaded target and head (specheads.bench.session.load_session).
        out: where the table, the identity checks and the cost lines are printed.

    Returns:
        The summary, also written to OUT.summary.json beside OUT.jsonl (one row per question and
        method) and the plots; its fields are in docs/contracts.md.
    """
    b = settings.bench
    questions = read_questions(b.questions, b.limit, b.per_category, b.categories)
    reference = (
        read_reference(b.reference, {"max_new_tokens": b.max_new_tokens, "temperature": settings.temperature})
        if b.reference
        else None
    )
    paths = output_paths(b.output)
    paths["rows"].parent.mkdir(parents=True, exist_ok=True)
    plan = plan_benchmark(settings, session)
    drafters = open_drafters(settings, session, questions, plan)
    assistant = assistant_for(settings, session, plan) if "assisted" in b.methods else None
    methods = list(b.methods) + [m for m in drafters if m not in b.methods]
    run = method_runner(settings, session.target, drafters, assistant)
    warm_up(run, settings, session.target, questions, methods, drafters)
    rows, prompts, bandwidth = time_questions(run, settings, session.target, questions, methods, paths["rows"])
    report = report_header(settings, session, len(questions), summarize(rows, methods), drafters, assistant)
    if bandwidth:
        report["memory_bandwidth"] = summarize_bandwidth(bandwidth, b.bandwidth_mib)
    report.update(method_reports(drafters, rows, session))
    report.update(output_checks(settings, session.target, rows, prompts, methods, reference))
    ran = {m: path for m, (_, _, path) in drafters.items()}
    report["record"] = results_record("bench", ran, b.questions, len(questions), report["machine"])
    write_outputs(report, paths, b.plots)
    print_report(report, paths, out)
    return report


def plan_benchmark(settings: InferJobConfig, session) -> DraftPlan:
    """What the benchmark's drafting methods draft, resolved once from the tree settings and the
    session head's calibration (skip: the layer skip's own choice; draft also for `assisted`,
    whose draft length it sets)."""
    methods = settings.bench.methods
    planned = [m for m in DRAFTING_METHODS if m != "skip" and (m in methods or m == "draft" and "assisted" in methods)]
    return plan_drafts(session.head, settings.tree, planned, settings.bench.prompt_lookup_num_tokens)


def open_drafters(settings: InferJobConfig, session, questions: Sequence[dict], plan: DraftPlan) -> dict[str, tuple]:
    """method -> (drafter, tree policy, what drafts) of every method drafting through our loop:
    bench.methods' own (session.method_drafter, the plan's policies) and bench.heads,
    bench.head_dtypes, bench.trees beside them; one line for each whose tree was calibrated on
    questions measured here."""
    b = settings.bench
    drafters = {m: method_drafter(session, m, plan) for m in DRAFTING_METHODS if m in b.methods}
    drafters.update(open_compared_heads(b.heads, session))
    if b.head_dtypes:
        drafters.update(open_precision_variants(b.head_dtypes, session, drafters["spec"][1]))
    if b.trees:
        drafters.update(open_tree_variants(b.trees, session))
    for method, (drafter, _, _) in drafters.items():
        # a tree chosen on the questions it is measured on flatters its head
        warn_overlap(method, getattr(drafter.head, "calibration", None), questions, b.turns, sys.stderr)
    return drafters


def method_runner(settings: InferJobConfig, target, drafters: dict, assistant) -> Callable[..., dict]:
    """run(method, prompt ids, sampling config) -> the method's answer and measurements; every
    method samples from generators seeded here with settings.seed."""
    gen = torch.Generator(device=target.device).manual_seed(settings.seed)
    torch.manual_seed(settings.seed)  # transformers' sampling draws from the global generator
    lookup = (settings.bench.prompt_lookup_num_tokens, settings.bench.prompt_lookup_max_ngram)

    def run(method: str, ids: list[int], c: SamplingConfig) -> dict:
        prompt = torch.tensor([ids], device=target.device)
        if method in drafters:
            return run_spec(target, drafters[method][0], prompt, c, generator=gen)
        if method == "plain":
            return run_spec(target, PlainDrafter(), prompt, c, generator=gen)
        if method == "assisted":
            return hf_generate(target, prompt, c, assistant=assistant)
        return hf_generate(target, prompt, c, lookup if method == "prompt_lookup" else None)

    return run


def warm_up(run, settings: InferJobConfig, target, questions, methods, drafters: dict) -> None:
    """Every method on the first bench.warmup questions, short and untimed (first calls pay for lazy
    initialisation); then the drafters that remember earlier answers forget the warm-up's."""
    b = settings.bench
    warm = sampling_config(settings, min(16, b.max_new_tokens), eos_token_ids(target))
    for q in questions[: b.warmup]:
        ids = encode_prompt(target.tokenizer, q["prompt"], settings.system, settings.chat)
        for m in methods:
            run(m, ids, warm)
    for drafter, _, _ in drafters.values():
        if hasattr(drafter, "forget_history"):  # the warm-up's answers must not seed the questions timed
            drafter.forget_history()


def time_questions(run, settings: InferJobConfig, target, questions, methods, path: Path) -> tuple[list, dict, list]:
    """Every method on every question, timed: (the rows, also written to `path` as they come and
    moved into place at the end; the prompt ids by (question_id, turn, method); the memory
    bandwidth sampled before each question, CPU targets only)."""
    b = settings.bench
    cfg = sampling_config(settings, b.max_new_tokens, eos_token_ids(target))
    # on CPU a one-row step follows the memory bandwidth of the moment: sample it between questions
    probe = BandwidthProbe(b.bandwidth_mib) if b.bandwidth_mib and target.device.type == "cpu" else None
    bandwidth: list[float] = []
    rows: list[dict] = []
    prompts: dict[tuple, list[int]] = {}  # (question_id, turn, method) -> prompt ids
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for qi, q in enumerate(
                tqdm(questions, desc="benchmark", unit="question", file=sys.stderr, dynamic_ncols=True)
            ):
                # rotate the order so that no method always runs first (caches, clocks)
                order = methods[qi % len(methods) :] + methods[: qi % len(methods)]
                copy_gb_s = probe.sample() if probe is not None else None
                if copy_gb_s is not None:
                    bandwidth.append(copy_gb_s)
                for row, ids in question_rows(run, settings, target.tokenizer, q, order, cfg):
                    if copy_gb_s is not None:
                        row["copy_gb_s"] = copy_gb_s
                    prompts[q["question_id"], row["turn"], row["method"]] = ids
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return rows, prompts, bandwidth


def question_rows(run, settings: InferJobConfig, tok, q: dict, order, cfg) -> Iterator[tuple[dict, list[int]]]:
    """One question's (row, prompt ids), turn by turn, each method in `order` answering a turn
    after its own answers to the turns before it."""
    turns = q["turns"] if settings.bench.turns == "all" else q["turns"][:1]
    answers: dict[str, list[str]] = {m: [] for m in order}  # each method's own earlier answers
    for turn in range(1, len(turns) + 1):
        for m in order:
            ids = encode_turns(tok, turns[:turn], answers[m], settings.system, settings.chat)
            r = run(m, ids, cfg)
            answers[m].append(tok.decode(r["output_ids"], skip_special_tokens=True))
            row = {
                "question_id": q["question_id"],
                "category": q["category"],
                "turn": turn,
                "method": m,
                "prompt_tokens": len(ids),
                "new_tokens": len(r["output_ids"]),
                **r,
            }
            row["tau"] = tau_of(row["new_tokens"], row["target_forwards"])
            row["tokens_per_s"] = row["new_tokens"] / row["wall_s"] if row["wall_s"] else 0.0
            yield row, ids


def report_header(settings: InferJobConfig, session, questions: int, summary: dict, drafters, assistant) -> dict:
    """The summary's run-wide fields: the models, the machine, the settings, each method's summary."""
    target, head, b = session.target, session.head, settings.bench
    report: dict[str, Any] = {
        "target": target.info.name,
        "head": str(session.head_dir) if session.head_dir else None,
        "family": head.family if head is not None else None,
        "tree": describe_policy(drafters["spec"][1]) if "spec" in drafters else None,
        "device": str(target.device),
        "machine": machine_record(target.device, kernels=session.layouts is not None),
        "dtype": str(target.dtype).replace("torch.", ""),
        "head_dtype": draft_precision(head) if head is not None else None,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "max_new_tokens": b.max_new_tokens,
        "questions": questions,
        "turns": b.turns,
        "methods": summary,
    }
    if session.draft is not None:
        report["draft_model"] = session.draft.describe()
        if assistant is not None:
            report["draft_model"]["assisted"] = {
                "num_assistant_tokens": assistant.tokens,
                "schedule": assistant.schedule,
                "universal": assistant.tokenizer is not None,
            }
    return report


def method_reports(drafters: dict, rows: Sequence[dict], session) -> dict:
    """Each drafting method's tree, acceptance per depth and step costs: the main head's at the top
    level, hybrid's with its sources and choices, lookup, suffix, draft and skip under their names,
    the heads compared beside them under compared_heads."""
    heads = {
        m: {
            "head": path,
            "head_dtype": draft_precision(drafter.head) if getattr(drafter, "head", None) is not None else None,
            "tree": describe_policy(policy),
            "acceptance_per_depth": acceptance_per_depth([r for r in rows if r["method"] == m]),
            "costs": cost_breakdown(rows, m),
        }
        for m, (drafter, policy, path) in drafters.items()
    }
    report: dict[str, Any] = {}
    if "spec" in heads:  # the main head's entries sit at the top level of the summary
        main = heads.pop("spec")
        report["acceptance_per_depth"], report["costs"] = main["acceptance_per_depth"], main["costs"]
    if "hybrid" in heads:
        report["hybrid"] = heads.pop("hybrid")
        report["hybrid"]["accepted_sources"] = source_shares([r for r in rows if r["method"] == "hybrid"])
        choices = getattr(drafters["hybrid"][0], "choices", {})
        if choices:  # the adaptive rule's steps by what they drafted
            report["hybrid"]["choices"] = {
                describe_choice(c): n for c, n in sorted(choices.items(), key=lambda x: (x[0].head, x[0].text_nodes))
            }
    for m in ("lookup", "suffix", "draft", "skip"):
        if m in heads:
            report[m] = heads.pop(m)
    if "skip" in report:
        report["skip"].update(session.skip.describe())
    if heads:
        report["compared_heads"] = heads
    return report


def output_checks(settings: InferJobConfig, target, rows, prompts: dict, methods, reference) -> dict:
    """Whether each method's answers equal the baseline's (else, at temperature 0, our own plain
    loop's), and their agreement with bench.reference's baseline answers."""
    checks: dict[str, Any] = {}
    if "baseline" in methods:
        checks["identical_to_baseline"] = compare_to_baseline(
            target, rows, prompts, methods, greedy=settings.temperature <= 0
        )
    elif "plain" in methods and settings.temperature <= 0:  # no HF baseline: our own plain loop's answers
        checks["identical_to_plain"] = compare_outputs(rows, methods, "plain")
    if reference is not None:
        checks["agreement_with_reference"] = {
            "reference": str(settings.bench.reference),
            "methods": agreement(rows, reference, methods),
        }
    return checks


def write_outputs(report: dict, paths: dict[str, Path], plots: bool) -> None:
    """OUT.summary.json, and with bench.plots the tau and acceptance plots."""
    write_json(paths["summary"], report)
    if plots:
        from .plots import plot_acceptance_per_depth, plot_tau_per_category

        plot_tau_per_category(report["methods"], paths["tau_png"])
        if "acceptance_per_depth" in report:
            plot_acceptance_per_depth(report["acceptance_per_depth"], paths["acceptance_png"])


def print_report(report: dict, paths: dict[str, Path], out: TextIO) -> None:
    """The table, the identity checks, the costs and each method's lines, and where the files are."""
    out.write(format_table(report["methods"]) + "\n")
    for m, cmp in report.get("identical_to_plain", {}).items():
        out.write(f"{m}: {cmp['equal']}/{cmp['total']} outputs identical to plain\n")
    for m, cmp in report.get("identical_to_baseline", {}).items():
        out.write(f"{m}: {cmp['equal']}/{cmp['total']} outputs identical to baseline\n")
        for d in cmp["divergences"]:
            out.write(
                f"  question {d['question_id']} turn {d['turn']}: first differs at token {d['index']} "
                f"(target top-2 logit margin there {d['top2_margin']:.4f})\n"
            )
    if "agreement_with_reference" in report:
        out.write("".join(line + "\n" for line in format_agreement(report["agreement_with_reference"]["methods"])))
    if report.get("costs"):
        out.write(format_costs(report["costs"]) + "\n")
    if "memory_bandwidth" in report:
        out.write(format_bandwidth(report["memory_bandwidth"]) + "\n")
    if report.get("hybrid"):
        info = report["hybrid"]
        out.write(f"{info['tree']}\n")  # it starts with "hybrid: "
        if info["costs"]:
            out.write(f"hybrid: {format_costs(info['costs'])}\n")
        if info["accepted_sources"]:
            out.write(f"hybrid: {format_shares(info['accepted_sources'])}\n")
        if info.get("choices"):
            total = sum(info["choices"].values())
            shares = ", ".join(f"{k} {n / total:.0%}" for k, n in info["choices"].items())
            out.write(f"hybrid: steps by choice: {shares}\n")
    if "draft_model" in report:
        out.write(f"draft model: {describe_draft_model(report['draft_model'])}\n")
    for m in ("lookup", "suffix", "draft", "skip"):
        if report.get(m, {}).get("costs"):
            out.write(f"{m} ({report[m]['tree']}): {format_costs(report[m]['costs'])}\n")
    for m, info in report.get("compared_heads", {}).items():
        if info["costs"]:
            out.write(f"{m}: {format_costs(info['costs'])}\n")
    out.write(f"rows: {paths['rows']}\nsummary: {paths['summary']}\n")
    out.flush()


def assistant_for(settings: InferJobConfig, session, plan: DraftPlan) -> Assistant:
    """The `assisted` method's settings: session's draft model drafting draft.assistant_tokens per
    step (else the draft method's depth); transformers re-encodes drafts as text (universal
    assisted decoding) only when the two vocabularies' sizes differ."""
    draft = session.draft
    d = settings.draft
    tokens = d.assistant_tokens or policy_depth(plan.policy("draft"))
    sizes = {m.config.get_text_config().vocab_size for m in (session.target.model, draft.model)}
    return Assistant(draft.model, tokens, d.assistant_schedule, draft.tokenizer if len(sizes) > 1 else None)


def describe_draft_model(info: dict) -> str:
    """The draft model in one line: its name, size, and where its layers came from."""
    size = f"{info['layers']} layers, {info['parameters'] / 1e6:.1f}M parameters, {info['dtype']}"
    text = f"{info['model']} ({info['model_type']}, {size})"
    made = info.get("made_from")
    if made:
        source = f" ({made['source']})" if made.get("source") not in (None, made["target"]) else ""
        text += (
            f": the first {made['layers']} of {made['target_layers']} layers of {made['target']}{source} "
            "with its final norm and LM head"
        )
    if info.get("assisted"):
        a = info["assisted"]
        text += f"; assisted drafts {a['num_assistant_tokens']} tokens per step ({a['schedule']} schedule)"
    return text


def describe_choice(choice) -> str:
    """An adaptive hybrid step's choice in words: plain, text N, head, head+text N."""
    if choice.head:
        return f"head+text {choice.text_nodes}" if choice.text_nodes else "head"
    return f"text {choice.text_nodes}" if choice.text_nodes else "plain"


def compare_outputs(rows, methods, reference: str, divergence=None) -> dict:
    """How many answers of each method equal `reference`'s answer to the same question and turn;
    divergence(question_id, turn, reference_ids, other_ids), when given, describes each that does
    not (first_divergence at temperature 0)."""
    by_key = {(r["question_id"], r.get("turn", 1), r["method"]): r for r in rows}
    answers = [(q, t) for (q, t, m) in by_key if m == reference]
    out = {}
    for m in methods:
        if m == reference:
            continue
        equal, divergences = 0, []
        for q, t in answers:
            base, other = by_key[q, t, reference], by_key[q, t, m]
            if base["output_ids"] == other["output_ids"]:
                equal += 1
            elif divergence is not None:
                divergences.append(
                    {"question_id": q, "turn": t, **divergence(q, t, base["output_ids"], other["output_ids"])}
                )
        out[m] = {"equal": equal, "total": len(answers), "divergences": divergences}
    return out


def compare_to_baseline(target, rows, prompts: dict, methods, greedy: bool) -> dict:
    """How many answers equal the baseline's (compare_outputs); at temperature 0 also where and how
    close the first divergence is (a tiny top-2 margin means a numerical tie, not a verification bug).

    prompts: (question_id, turn, method) -> prompt ids."""

    def divergence(q, t, base, other):
        return first_divergence(target, prompts[q, t, "baseline"], base, other)

    return compare_outputs(rows, methods, "baseline", divergence if greedy else None)
