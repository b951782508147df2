"""`make engines`: our exported heads in a real serving engine (vLLM's CPU build), beside infer.py.

    python engines/compare.py [--questions Q.jsonl] [--num-questions 8] [--max-new-tokens 64] [--k 3 ...]
                              [--peers ngram suffix] [--formats eagle3 ...] [--out DIR]

A development tool of the repository (it runs the checkout's train.py and infer.py and the shipped
head), so it lives beside the package, not in it. The questions default to the package's shipped
dev set; MT-bench or any other FastChat question.jsonl is given with --questions.

1. heads: the shipped EAGLE-3 head; EAGLE-1, Medusa, P-EAGLE and DFlash heads given with
   --eagle-head, --medusa-head, --peagle-head and --dflash-head, else trained for a few steps with
   train.py (enough to test loading and agreement, not speed); and EAGLE-3 heads trained elsewhere
   (--given NAME=DIR: a speculators-format directory, such as `make peer`'s), which vLLM loads as
   they are and infer.py reads back onto the target (`model=smollm2-135m`);
2. exports: every format vLLM loads (`python -m specheads.export`);
3. vLLM: engines/vllm_run.py in vLLM's own virtualenv runs plain greedy, each export and vLLM's own
   model-free speculation (--peers: ngram, and Suffix Decoding, which needs arctic-inference in
   vLLM's virtualenv) on the same prompt token ids, with chains of K tokens for every K given;
4. infer.py: the same heads, prompts and chain lengths (tree=chain tree.depth=K);
5. one table per K: loaded, greedy outputs identical to vLLM plain, acceptance in vLLM and in
   infer.py, tokens/s at batch 1 and batch 8; saved as OUT/engines.json and OUT/engines.md.

With several K a run is named `NAME-kK` (eagle3-k2, suffix-k2, ...); with one K, just NAME.
A Medusa export runs at the largest K only: vLLM drafts one token per Medusa head.
A DFlash head drafts at most block_size - 1 tokens (its trained block, which our drafter always runs
whole): a larger K is not run and its row says so; a smaller K runs in vLLM on a shorter block than
trained (infer.py keeps the first K drafts of the whole block), which the row's note says.

Acceptance is counted the way vLLM counts it: per verified draft, the number of drafted tokens
accepted; mean acceptance length = 1 + accepted / drafts (the bonus token included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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

ROOT = Path(__file__).resolve().parents[1]  # the checkout this tool belongs to (engines/..)
RUNNER = ROOT / "engines" / "vllm_run.py"
SHIPPED_EAGLE3 = ROOT / "heads" / "smollm2-135m-eagle3"
# run name -> (head family, export format, vLLM's speculative_config fields beside model and K).
# P-EAGLE is the eagle3 method drafting every position in one forward (parallel_drafting).
PARALLEL = {"method": "eagle3", "parallel_drafting": True}
FORMATS = {
    "eagle3": ("eagle3", "eagle3", {"method": "eagle3"}),
    "speculators": ("eagle3", "speculators", {"method": "eagle3"}),
    "eagle": ("eagle", "eagle", {"method": "eagle"}),
    "vllm-medusa": ("medusa", "vllm-medusa", {"method": "medusa"}),
    "peagle": ("peagle", "eagle3", PARALLEL),
    "peagle-speculators": ("peagle", "speculators", PARALLEL),
    "dflash": ("dflash", "dflash", {"method": "dflash"}),
    "dflash-speculators": ("dflash", "speculators", {"method": "dflash"}),
}
DEFAULT_FORMATS = ["eagle3", "speculators", "eagle", "vllm-medusa", "peagle"]
# vLLM's model-free drafters run beside the heads. Suffix Decoding keeps a tree of earlier answers
# (its defaults otherwise), so its batched pass gets a fresh engine: else it would be timed on
# answers to the very prompts it has just seen.
PEERS = {
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
}
FRESH_ENGINE_PER_PASS = {"suffix"}
WARMUP_PROMPT = "Say hello in one short sentence."  # not a benchmark question: warms the engine only
# 2 GiB of vLLM CPU KV cache is plenty for SmolLM2 at these lengths.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
ERROR_LINE = re.compile(r"\b(\w+(Error|Exception)): (.+)$")


# -- acceptance, identity, agreement (pure) -------------------------------------------------------


def acceptance_from_counters(counters: dict | None, output_ids: Sequence[Sequence[int]] | None = None) -> dict | None:
    """vLLM's spec-decode counters -> mean acceptance length and per-position acceptance rates.

    vLLM drafts a full chain even when fewer tokens are left to generate, and its scheduler counts a
    draft's accepted tokens before the answer is cut at max_tokens (or after its end token): near
    each answer's end it counts accepts that never reach the output, where infer.py drafts only what
    can still be kept. Given the outputs, `kept_acceptance_length` counts what reached them: every
    generated token but each answer's first (the prefill's), over the drafts."""
    drafts = (counters or {}).get("num_drafts", 0)
    if not drafts:
        return None
    per_pos = [n / drafts for n in counters.get("accepted_per_pos", [])]
    kept = sum(len(o) for o in output_ids) - len(output_ids) if output_ids else None
    return {
        "drafts": drafts,
        "mean_acceptance_length": 1 + counters["num_accepted_tokens"] / drafts,
        "kept_acceptance_length": kept / drafts if kept is not None else None,
        "per_position": per_pos,
        "stderr": None,
    }


def acceptance_from_steps(accepted: Sequence[int], k: int) -> dict | None:
    """infer.py's accepted-draft count per verify step -> the same numbers as vLLM's counters, plus
    the standard error of the mean acceptance length (steps taken as independent)."""
    n = len(accepted)
    if not n:
        return None
    mean = sum(accepted) / n
    var = sum((a - mean) ** 2 for a in accepted) / max(n - 1, 1)
    return {
        "drafts": n,
        "mean_acceptance_length": 1 + mean,
        "per_position": [sum(a >= p for a in accepted) / n for p in range(1, k + 1)],
        "stderr": math.sqrt(var / n),
    }


def count_identical(outputs: Sequence[Sequence[int]] | None, reference: Sequence[Sequence[int]] | None) -> tuple:
    """(equal, total): how many outputs are token-for-token the reference's (missing ones differ)."""
    reference = list(reference or [])
    outputs = list(outputs or [])
    equal = sum(i < len(outputs) and list(outputs[i]) == list(ref) for i, ref in enumerate(reference))
    return equal, len(reference)


def agrees(ours: dict | None, theirs: dict | None, floor: float = 0.05, sigmas: float = 3.0) -> bool | None:
    """Same head, prompts and chain: do the mean acceptance lengths agree within noise?

    vLLM's is taken as what reached its outputs (`kept_acceptance_length`) where known. The noise
    allowed is `sigmas` standard errors of infer.py's mean (or `floor`, whichever is larger): the
    two runs share the prompts, so only numerical near-ties should separate them."""
    if ours is None or theirs is None:
        return None
    tol = max(floor, sigmas * (ours.get("stderr") or 0.0))
    kept = theirs.get("kept_acceptance_length")
    vllm = theirs["mean_acceptance_length"] if kept is None else kept
    return abs(ours["mean_acceptance_length"] - vllm) <= tol


def root_cause(log_lines: Sequence[str]) -> str | None:
    """The last `SomethingError: message` line of a log: the engine process's own reason, which
    vLLM's front end reports only as 'Engine core initialization failed'."""
    for line in reversed(log_lines):
        m = ERROR_LINE.search(line)
        if m and "Engine core initialization failed" not in m.group(3):
            return f"{m.group(1)}: {m.group(3).strip()}"
    return None


# -- the table (pure) -----------------------------------------------------------------------------


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _acc(a: dict | None) -> tuple[str, str]:
    if a is None:
        return "-", "-"
    length = f"{a['mean_acceptance_length']:.2f}"
    if a.get("kept_acceptance_length") is not None:
        length += f" ({a['kept_acceptance_length']:.2f} kept)"
    return length, " ".join(f"{p:.2f}" for p in a["per_position"])


def table_rows(vllm: dict, infer: dict, names: Sequence[str] | None = None) -> list[dict]:
    """One row per vLLM run (plain, each format, each peer; only `names` when given), vLLM's plain
    outputs as the reference."""
    plain = vllm.get("plain") or {}
    reference = plain.get("output_ids")
    rows = []
    for name, res in vllm.items():
        if names is not None and name not in names:
            continue
        vacc = acceptance_from_counters(res.get("spec"), res.get("output_ids"))
        ours = infer.get(name) or {}
        iacc = ours.get("acceptance")
        rows.append(
            {
                "run": name,
                "loaded": bool(res.get("loaded")) and not res.get("error"),
                "error": res.get("error"),
                "identical": count_identical(res.get("output_ids"), reference) if res.get("output_ids") else None,
                "vllm_acceptance": vacc,
                "infer_acceptance": iacc,
                "infer_identical": count_identical(ours.get("output_ids"), reference) if ours else None,
                "agree": agrees(iacc, vacc),
                "tokens_per_s_batch1": res.get("tokens_per_s_batch1"),
                "tokens_per_s_batch": res.get("tokens_per_s_batch"),
                "speedup_batch1": _ratio(res.get("tokens_per_s_batch1"), plain.get("tokens_per_s_batch1")),
                "speedup_batch": _ratio(res.get("tokens_per_s_batch"), plain.get("tokens_per_s_batch")),
            }
        )
    return rows


def _ratio(a, b):
    return a / b if a and b else None


def format_table(rows: Sequence[dict], k: int, batch: int, skipped: dict[str, str] | None = None) -> str:
    """A markdown table; load errors, disagreements, each row's note and the runs not run at this K
    (`skipped`: name -> reason) are listed under it, one line each."""
    head = [
        "run",
        "loaded",
        "= vLLM plain",
        "vLLM accept len",
        f"vLLM per position (K={k})",
        "infer.py accept len",
        "infer.py per position",
        "agree",
        "tok/s b1",
        "x plain",
        f"tok/s b{batch}",
        "x plain",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for r in rows:
        ident = f"{r['identical'][0]}/{r['identical'][1]}" if r["identical"] else "-"
        vlen, vpos = _acc(r["vllm_acceptance"])
        ilen, ipos = _acc(r["infer_acceptance"])
        agree = {None: "-", True: "yes", False: "NO"}[r["agree"]]
        cells = [
            r["run"],
            "yes" if r["loaded"] else "NO",
            ident,
            vlen,
            vpos,
            ilen,
            ipos,
            agree,
            _num(r["tokens_per_s_batch1"], ".1f"),
            _num(r["speedup_batch1"], ".2f"),
            _num(r["tokens_per_s_batch"], ".1f"),
            _num(r["speedup_batch"], ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        if r["error"]:
            notes.append(f"- {r['run']}: {r['error']}")
        if r["agree"] is False:
            notes.append(f"- {r['run']}: acceptance differs between vLLM ({vlen}) and infer.py ({ilen})")
        if r["infer_identical"] and r["infer_identical"][0] != r["infer_identical"][1]:
            n, t = r["infer_identical"]
            notes.append(f"- {r['run']}: infer.py's outputs equal vLLM plain's in {n}/{t} (numerics of two kernels)")
        if r.get("note"):
            notes.append(f"- {r['run']}: {r['note']}")
    for name, reason in (skipped or {}).items():
        lines.append("| " + " | ".join([name, "not run"] + ["-"] * (len(head) - 2)) + " |")
        notes.append(f"- {name}: not run: {reason}")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# -- subprocesses -----------------------------------------------------------------------------------


def run_logged(what: str, cmd: Sequence[str], log: Path, env: dict | None = None, on_line=None) -> None:
    """Run a command with its output in `log`; a failure is one line naming `what` and the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            list(map(str, cmd)), cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            f.write(line)
            if on_line is not None:
                on_line(line)
        code = proc.wait()
    if code != 0:
        tail = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        reason = root_cause(tail) or (tail[-1] if tail else "no output")
        raise SpecHeadsError(f"{what} failed ({reason}); log: {log}")


def train_head(family: str, out: Path, steps: int, k: int, logs: Path) -> Path:
    """A quick head for `family` (reused when OUT/head exists): enough to test loading and agreement.
    Medusa gets K heads and DFlash a block of K + 1 slots: both then draft the largest K."""
    head = out / "head"
    if (head / "config.json").is_file():
        return head
    cmd = [sys.executable, "train.py", f"head={family}", f"train.max_steps={steps}", "train.eval_every=0"]
    if family == "medusa":
        cmd.append(f"head.num_heads={k}")  # vLLM drafts one token per Medusa head
    if family == "dflash":
        cmd.append(f"head.block_size={k + 1}")  # the bonus token's slot, then K drafts
    cmd += ["wandb.mode=disabled", f"output_dir={out}"]
    run_logged(f"train.py head={family}", cmd, logs / f"train-{family}.log")
    return head


def export(head: Path, fmt: str, out: Path, k: int, logs: Path) -> Path:
    cmd = [sys.executable, "-m", "specheads.export", f"head={head}", f"format={fmt}", f"out={out}"]
    run_logged(f"export format={fmt}", cmd + [f"num_speculative_tokens={k}"], logs / f"export-{out.name}.log")
    return out


def infer_chain(head: Path, questions: Path, args, k: int, out: Path, logs: Path, given: bool = False) -> dict:
    """infer.py's benchmark, spec only, a chain of K: accepted drafts per step and the outputs.
    A head exported elsewhere (`given`) is read back onto the target it was trained for."""
    cmd = [
        sys.executable,
        "infer.py",
        f"head={head}",
        *(["model=smollm2-135m"] if given else []),
        "head_dtype=target",  # vLLM drafts in the target's fp32: the same arithmetic, not auto's bf16
        "tree=chain",
        f"tree.depth={k}",
        "temperature=0",
        f"bench.questions={questions}",
        f"bench.limit={args.num_questions}",
        f"bench.per_category={args.per_category or 'null'}",
        "bench.methods=[spec]",
        f"bench.max_new_tokens={args.max_new_tokens}",
        f"bench.output={out}",
        "bench.plots=false",
        "bench.warmup=0",
    ]
    run_logged(f"infer.py head={head}", cmd, logs / f"infer-{out.stem}.log")
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    accepted = [n for r in rows for n in r.get("accepted_drafts", [])]
    return {
        "acceptance": acceptance_from_steps(accepted, k),
        "output_ids": [r["output_ids"] for r in rows],
        "tau": sum(r["new_tokens"] for r in rows) / max(1, sum(r["target_forwards"] for r in rows)),
    }


def run_vllm(python: Path, spec: dict, work: Path, logs: Path, progress) -> dict:
    spec_path, out_path = work / "vllm_spec.json", work / "vllm_results.json"
    write_json(spec_path, spec)
    out_path.unlink(missing_ok=True)  # never read a previous run's results
    env = dict(VLLM_ENV)
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():  # vLLM warns that CPU speculation is much slower without Intel OpenMP
        env["LD_PRELOAD"] = str(iomp)

    def on_line(line: str) -> None:
        m = re.match(r"vllm_run: (\S+)( done)?$", line.strip())
        if m:
            progress.set_description(f"vLLM {m.group(1)}")
            if m.group(2):
                progress.update(1)

    log = logs / "vllm.log"
    run_logged("vLLM", [python, RUNNER, spec_path, out_path], log, env, on_line)
    results = json.loads(out_path.read_text(encoding="utf-8"))
    sections = split_log(log.read_text(encoding="utf-8", errors="replace").splitlines())
    for name, res in results.items():  # the engine process's own reason for a failed load
        if res.get("error") and "Engine core initialization failed" in res["error"]:
            res["error"] = root_cause(sections.get(name, [])) or res["error"]
    return results


def split_log(lines: Sequence[str]) -> dict[str, list[str]]:
    """The runner's log cut into its runs (each starts with a `vllm_run: NAME` line)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in lines:
        m = re.match(r"vllm_run: (\S+)( done)?$", line.strip())
        if m:
            current = None if m.group(2) else m.group(1)
            if current is not None:
                out[current] = []
        elif current is not None:
            out[current].append(line)
    return out


# -- the job ------------------------------------------------------------------------------------------


def prompt_ids(
    questions: Path, num: int, per_category: int | None
) -> tuple[list[dict], list[list[int]], str, list[int]]:
    """The questions and their chat-template token ids, exactly as infer.py encodes them, and the
    warm-up prompt's."""
    from transformers import AutoTokenizer

    from specheads.bench.inputs import encode_prompt
    from specheads.bench.questions import read_questions
    from specheads.target import _dequantized_embedded

    target_dir = _dequantized_embedded("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    rows = read_questions(questions, num, per_category)
    ids = [encode_prompt(tokenizer, q["prompt"]) for q in rows]
    return rows, ids, str(target_dir), encode_prompt(tokenizer, WARMUP_PROMPT)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python engines/compare.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--questions",
        type=Path,
        default=DEV_QUESTIONS,
        help="FastChat question.jsonl (first turns); default: the dev set",
    )
    p.add_argument("--num-questions", type=int, default=8)
    p.add_argument("--per-category", type=int, default=1, help="first N questions of each category (0: no limit)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[3],
        help="chain lengths (num_speculative_tokens, tree.depth), one table each",
    )
    p.add_argument(
        "--peers",
        nargs="*",
        default=["ngram"],
        choices=list(PEERS),
        help="vLLM's model-free drafters run beside the heads (suffix needs arctic-inference in vLLM's virtualenv)",
    )
    p.add_argument("--batch", type=int, default=8, help="requests in the batched throughput pass")
    p.add_argument("--eagle3-head", type=Path, default=SHIPPED_EAGLE3)
    p.add_argument("--eagle-head", type=Path, default=None, help="default: train one in --heads-dir")
    p.add_argument("--medusa-head", type=Path, default=None, help="default: train one in --heads-dir")
    p.add_argument("--peagle-head", type=Path, default=None, help="default: train one in --heads-dir")
    p.add_argument("--dflash-head", type=Path, default=None, help="default: train one in --heads-dir")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--heads-dir", type=Path, default=ROOT / "runs" / "engines" / "heads")
    p.add_argument("--formats", nargs="*", default=DEFAULT_FORMATS, choices=list(FORMATS))
    p.add_argument(
        "--given",
        nargs="*",
        default=[],
        metavar="NAME=DIR",
        help="EAGLE-3 heads trained elsewhere (speculators format), run as they are in vLLM and read by infer.py",
    )
    p.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "engines")
    args = p.parse_args(argv)
    if not args.vllm_python.is_file():
        raise SpecHeadsError(f"{args.vllm_python} does not exist: run `make engines` (it builds vLLM's virtualenv)")
    if not args.questions.is_file():
        raise SpecHeadsError(f"--questions {args.questions} does not exist")
    args.given = given_heads(args.given, {*FORMATS, *(f[0] for f in FORMATS.values()), *PEERS, "plain"})
    args.k = sorted(set(args.k))
    if min(args.num_questions, args.max_new_tokens, *args.k, args.batch, args.train_steps) < 1:
        raise SpecHeadsError("--num-questions, --max-new-tokens, --k, --batch and --train-steps must be >= 1")
    args.per_category = args.per_category or None
    return args


def given_heads(pairs: Sequence[str], taken: set[str]) -> dict[str, Path]:
    """--given NAME=DIR ...: name -> an EAGLE-3 head directory in the speculators format."""
    heads = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or name in taken or name in heads:
            raise SpecHeadsError(f"--given {pair!r}: expected NAME=DIR with a new NAME (not {sorted(taken)})")
        config = Path(path) / "config.json"
        if not config.is_file():
            raise SpecHeadsError(f"--given {pair!r}: {config} does not exist")
        kind = json.loads(config.read_text(encoding="utf-8")).get("speculators_model_type")
        if kind != "eagle3":
            raise SpecHeadsError(f"--given {pair!r}: a speculators eagle3 head is expected, found {kind!r}")
        heads[name] = Path(path).resolve()
    return heads


def run_name(name: str, k: int, ks: Sequence[int]) -> str:
    return name if len(ks) == 1 else f"{name}-k{k}"


def draft_limit(family: str, head: Path) -> int | None:
    """The most tokens a head drafts per step, where its family has a limit: a DFlash head's
    block_size - 1 (the drafter runs the whole trained block), a P-EAGLE head's parallel_depths
    (the positions it was trained to fill; infer.py drafts no deeper). None: no limit."""
    if family not in ("dflash", "peagle"):
        return None
    config = json.loads((head / "config.json").read_text(encoding="utf-8"))
    fields = config.get("head") or config
    return int(fields["block_size"]) - 1 if family == "dflash" else int(fields["parallel_depths"])


def chain_lengths(family: str, ks: Sequence[int], limit: int | None = None) -> list[int]:
    """The K a head family runs at: every K up to its limit (draft_limit), but Medusa only at the
    largest (vLLM drafts one token per Medusa head)."""
    if family == "medusa":
        return [max(ks)]
    return [k for k in ks if limit is None or k <= limit]


def skipped_chains(family: str, ks: Sequence[int], limit: int | None) -> dict[int, str]:
    """K -> why it is not run: a DFlash head cannot draft past its block (capping K would label a
    shorter chain as this K)."""
    if limit is None:
        return {}
    trained = "its trained block" if family == "dflash" else "the positions it was trained to fill"
    return {k: f"K={k} > {limit}: a {family} head drafts at most {limit} tokens ({trained})" for k in ks if k > limit}


def regime_note(family: str, k: int, limit: int | None) -> str | None:
    """A DFlash head below its block: vLLM runs a block of 1 + K slots, shorter than the one the head
    was trained on, while infer.py runs the whole block and keeps the first K drafts."""
    if family != "dflash" or limit is None or k >= limit:
        return None
    return (
        f"K={k} < block_size - 1 = {limit}: off the training regime in vLLM (a block of {k + 1} slots, "
        f"trained on {limit + 1}); infer.py runs the whole block, so the acceptances need not agree"
    )


def annotations(formats: Sequence[str], k: int, ks: Sequence[int], limits: dict) -> tuple[dict, dict]:
    """At chain length K: (run name -> note on its row, run name -> why it is not run)."""
    notes, skipped = {}, {}
    for fmt in formats:
        family, name = FORMATS[fmt][0], run_name(fmt, k, ks)
        note = regime_note(family, k, limits.get(family))
        why = skipped_chains(family, ks, limits.get(family)).get(k)
        if note:
            notes[name] = note
        if why:
            skipped[name] = why
    return notes, skipped


def vllm_runs(
    exports: dict, peers: Sequence[str], ks: Sequence[int], limits: dict | None = None, given: dict | None = None
) -> list[dict]:
    """vLLM plain, then per K every export (up to its family's limit, `limits`: family -> K), every
    EAGLE-3 head given as it is (`given`: name -> directory) and every peer."""
    limits = limits or {}
    runs = [{"name": "plain", "speculative_config": None}]
    for k in ks:
        for name, path in (given or {}).items():
            config = {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}
            runs.append({"name": run_name(name, k, ks), "speculative_config": config})
        for fmt, path in exports.items():
            family = FORMATS[fmt][0]
            if k in chain_lengths(family, ks, limits.get(family)):
                config = {**FORMATS[fmt][2], "model": str(path), "num_speculative_tokens": k}
                runs.append({"name": run_name(fmt, k, ks), "speculative_config": config})
        for peer in peers:
            run = {"name": run_name(peer, k, ks), "speculative_config": {**PEERS[peer], "num_speculative_tokens": k}}
            if peer in FRESH_ENGINE_PER_PASS:
                run["fresh_engine_per_pass"] = True
            runs.append(run)
    return runs


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    out, logs = args.out.resolve(), args.out.resolve() / "logs"
    ks = args.k
    families = sorted({FORMATS[f][0] for f in args.formats})
    given = {
        "eagle3": args.eagle3_head,
        "eagle": args.eagle_head,
        "medusa": args.medusa_head,
        "peagle": args.peagle_head,
        "dflash": args.dflash_head,
    }
    to_train = [f for f in families if given[f] is None]
    with tqdm(total=len(to_train) + len(args.formats), desc="engines", unit="step", file=sys.stderr) as bar:
        heads = {}
        for fam in families:
            if given[fam] is None:
                bar.set_description(f"train {fam}")
                heads[fam] = train_head(fam, args.heads_dir.resolve() / fam, args.train_steps, max(ks), logs)
                bar.update(1)
            else:
                heads[fam] = given[fam].resolve()
        limits = {fam: draft_limit(fam, heads[fam]) for fam in families}
        chains = [(fam, k) for fam in families for k in chain_lengths(fam, ks, limits[fam])]
        exports = {}
        for fmt in args.formats:
            bar.set_description(f"export {fmt}")
            fam = FORMATS[fmt][0]
            default_k = min(max(ks), limits[fam] or max(ks))  # the export's default K (each run sets its own)
            exports[fmt] = export(heads[fam], FORMATS[fmt][1], out / "export" / fmt, default_k, logs)
            bar.update(1)
        questions, prompts, target_dir, warmup = prompt_ids(args.questions, args.num_questions, args.per_category)
        runs = vllm_runs(exports, args.peers, ks, limits, args.given)
        bar.total += len(runs) + len(chains) + len(args.given) * len(ks)
        bar.refresh()
        spec = {
            "target": target_dir,
            "prompts": prompts,
            "warmup_prompt": warmup,
            "max_new_tokens": args.max_new_tokens,
            "batch": args.batch,
            "runs": runs,
        }
        vllm = run_vllm(args.vllm_python, spec, out, logs, bar)
        by_chain = {}
        for fam, k in chains:
            bar.set_description(f"infer.py {fam} K={k}")
            path = out / "infer" / f"{run_name(fam, k, ks)}.jsonl"
            by_chain[run_name(fam, k, ks)] = infer_chain(heads[fam], args.questions, args, k, path, logs)
            bar.update(1)
        for name, path in args.given.items():
            for k in ks:
                bar.set_description(f"infer.py {name} K={k}")
                out_path = out / "infer" / f"{run_name(name, k, ks)}.jsonl"
                by_chain[run_name(name, k, ks)] = infer_chain(path, args.questions, args, k, out_path, logs, given=True)
                bar.update(1)
    infer = {
        run_name(fmt, k, ks): by_chain[run_name(FORMATS[fmt][0], k, ks)]
        for fmt in args.formats
        for k in chain_lengths(FORMATS[fmt][0], ks, limits[FORMATS[fmt][0]])
    }
    infer.update({run_name(name, k, ks): by_chain[run_name(name, k, ks)] for name in args.given for k in ks})
    tables, rows, not_run = [], [], []
    for k in ks:
        names = ["plain"] + [
            r["name"]
            for r in runs
            if r["speculative_config"] and r["speculative_config"]["num_speculative_tokens"] == k
        ]
        notes, skipped = annotations(args.formats, k, ks, limits)
        k_rows = [{**r, "note": notes.get(r["run"])} for r in table_rows(vllm, infer, names)]
        rows += [{**r, "k": None if r["run"] == "plain" else k} for r in k_rows]
        not_run += [{"run": name, "k": k, "reason": why} for name, why in skipped.items()]
        title = "" if len(ks) == 1 else f"### K={k}\n\n"
        tables.append(title + format_table(k_rows, k, args.batch, skipped))
    report = {
        "target": target_dir,
        "questions": str(args.questions),
        "question_ids": [q["question_id"] for q in questions],
        "max_new_tokens": args.max_new_tokens,
        "k": ks[0] if len(ks) == 1 else ks,
        "batch": args.batch,
        "peers": list(args.peers),
        "heads": {**{fam: str(p) for fam, p in heads.items()}, **{n: str(p) for n, p in args.given.items()}},
        "exports": {fmt: str(p) for fmt, p in exports.items()},
        "rows": [r for i, r in enumerate(rows) if r["run"] != "plain" or i == 0],
        "not_run": not_run,  # runs a head cannot make at that K (a DFlash head past its block), and why
        "vllm": vllm,
        "infer": by_chain,
    }
    ran = {**{fam: p for fam, p in heads.items()}, **dict(args.given)}
    machine = machine_record(torch.device("cpu"), kernels=False)
    report["record"] = results_record("vllm", ran, args.questions, len(questions), machine)
    write_json(out / "engines.json", report)
    header = (
        f"vLLM (CPU build) vs infer.py: {len(questions)} questions of {args.questions.name}, "
        f"{args.max_new_tokens} new tokens, greedy, chains of K={', '.join(map(str, ks))}\n\n"
    )
    table = "\n".join(tables)
    write_text(out / "engines.md", header + table)
    print(header + table + f"\nresults: {out / 'engines.json'}, {out / 'engines.md'}", flush=True)
    return report


@one_line_errors
def main(argv: Sequence[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
