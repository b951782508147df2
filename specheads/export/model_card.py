"""README.md (Hub model card) for an exported head: YAML metadata, measured speed, training
config, and the exact command lines that serve it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from ..decode.tree import chain_paths
from ..errors import SpecHeadsError
from ..heads.registry import HEADS
from .common import HeadSource
from .hub import looks_like_hub_id

# -- serving commands -----------------------------------------------------------------------------


def sglang_tree_flags(src: HeadSource) -> str:
    """SGLang's (num_steps, eagle_topk, num_draft_tokens) from the default tree (docs defaults 5/4/8)."""
    tree = src.default_tree
    if not tree:
        return "--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
    steps = max(len(p) for p in tree)
    topk = max(max(p) for p in tree) + 1
    return (
        f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} "
        f"--speculative-num-draft-tokens {len(tree) + 1}"
    )


def serve_commands(
    src: HeadSource, fmt: str, engines: list[str], draft: str, target: str, tokens: int | None = None
) -> list[tuple[str, str]]:
    """(engine title, shell command) for every engine the export was written for."""
    k = src.speculative_tokens(tokens)
    out = []
    if "vllm" in engines:
        method = {"eagle3": "eagle3", "speculators": "eagle3", "eagle": "eagle", "vllm-medusa": "medusa"}.get(fmt, fmt)
        if src.family in ("dflash", "dflash2"):  # native or speculators: served by vLLM's dflash method
            method = "dflash"  # k: the whole block by default, the regime it was trained in
        if src.family == "dspark":  # speculators' dspark type: vLLM's dspark method, k the whole block
            method = "dspark"
        settings = {"method": method, "model": draft, "num_speculative_tokens": k}
        if src.family == "peagle":  # all K drafts from one forward: vLLM's parallel drafting of an EAGLE-3 draft
            settings["parallel_drafting"] = True
        spec_config = json.dumps(settings)
        if fmt == "speculators":
            out.append(("vLLM (the verifier is read from the speculators config)", f"vllm serve {draft}"))
        out.append(("vLLM", f"vllm serve {target} --speculative-config '{spec_config}'"))
    if "sglang" in engines:
        algo = "EAGLE3" if fmt == "eagle3" else "EAGLE"
        out.append(
            (
                "SGLang",
                f"python -m sglang.launch_server --model-path {target} "
                f"--speculative-algorithm {algo} --speculative-draft-model-path {draft} "
                f"{sglang_tree_flags(src)}",
            )
        )
    if "tgi" in engines:
        out.append(
            (
                "Text Generation Inference (loads base_model_name_or_path itself)",
                f"text-generation-launcher --model-id {draft} --speculate {k}",
            )
        )
    if "trtllm" in engines:
        spec = src.spec
        # without a default tree: one chain through every head's top-1 token
        choices = json.dumps(src.default_tree or chain_paths(spec.num_heads))
        out.append(
            (
                "TensorRT-LLM (TRT engine backend)",
                f"python examples/medusa/convert_checkpoint.py --model_dir {target} "
                f"--medusa_model_dir {draft} --output_dir ./medusa_ckpt --dtype float16 "
                f"--num_medusa_heads {spec.num_heads} --num_medusa_layers {spec.num_layers}\n"
                "trtllm-build --checkpoint_dir ./medusa_ckpt --output_dir ./medusa_engine "
                "--gemm_plugin float16 --speculative_decoding_mode medusa --max_batch_size 4\n"
                f"python examples/run.py --engine_dir ./medusa_engine --tokenizer_dir {target} "
                f"--medusa_choices '{choices}' --temperature 1.0 --max_output_len 100 "
                "--input_text 'Hello'",
            )
        )
    if "speculators" in engines:
        module, model = {
            "dflash": ("dflash", "DFlashDraftModel"),
            "dspark": ("dspark", "DSparkDraftModel"),
            "dflash2": ("dflash2", "DFlash2DraftModel"),
        }.get(src.family, ("eagle3", "Eagle3DraftModel"))
        out.append(
            (
                "speculators (Python)",
                f"python -c \"from speculators.models.{module} import {model}; {model}.from_pretrained('{draft}')\"",
            )
        )
    return out


# -- benchmark table ------------------------------------------------------------------------------

# (summary key, column title): the per-method, per-category stats of infer.py's OUT.summary.json
COLUMNS = (
    ("tau", "tau"),
    ("tokens_per_s", "tokens/s"),
    ("speedup_vs_baseline", "speedup vs HF greedy"),
    ("speedup_vs_plain", "vs own plain decoding"),
    ("speedup_vs_prompt_lookup", "vs prompt lookup"),
)


def check_bench_summary(summary: Any, where: str = "bench.summary") -> dict:
    """A benchmark summary as infer.py's bench mode writes it (docs/contracts.md), else one error."""
    methods = summary.get("methods") if isinstance(summary, dict) else None
    if not isinstance(methods, dict) or not all(isinstance(v, dict) for v in methods.values()):
        raise SpecHeadsError(f'{where} is not a benchmark summary of infer.py (OUT.summary.json with "methods")')
    return summary


def bench_table(summary: dict) -> str:
    """Markdown: one row per method and category ("all" first), the summary's own numbers."""
    lines = ["| method | category | questions | " + " | ".join(t for _, t in COLUMNS) + " |"]
    lines.append("|---" * (len(COLUMNS) + 3) + "|")
    for method, categories in summary["methods"].items():
        for category, stats in categories.items():
            cells = [f"{stats[k]:.2f}" if isinstance(stats.get(k), (int, float)) else "-" for k, _ in COLUMNS]
            lines.append(f"| {method} | {category} | {stats.get('questions', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_context(summary: dict) -> list[str]:
    """What the numbers were measured on, lossless checks and the cost line, as sentences."""
    keys = ("target", "device", "dtype", "tree", "questions", "max_new_tokens", "turns", "temperature")
    setting = ", ".join(f"{k} {summary[k]}" for k in keys if summary.get(k) is not None)
    out = [f"Measured with `infer.py` bench mode ({setting})."] if setting else []
    for method, cmp in (summary.get("identical_to_baseline") or {}).items():
        out.append(f"{method}: {cmp['equal']}/{cmp['total']} outputs identical to HF greedy.")
    costs = summary.get("costs")
    if costs:
        hf = costs.get("plain_step_ms")
        plain = (
            f"a plain step of {hf:.1f} ms"
            if hf
            else f"our own loop's plain step of {costs['own_plain_step_ms']:.1f} ms"
        )
        out.append(
            f"Cost of a speculative step: draft {costs['draft_ms']:.1f} ms + verify {costs['verify_ms']:.1f} ms "
            f"against {plain} (break-even tau {costs['break_even_tau']:.2f})."
        )
    return out


# -- the card ----------------------------------------------------------------------------------------


def model_card(
    src: HeadSource,
    fmt: str,
    engines: list[str],
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    bench_summary: Any = None,
    bench_source: str = "",
    num_speculative_tokens: int | None = None,
    notes: list[str] | None = None,
) -> str:
    family = src.family
    head_class = HEADS[family]
    target = base_model or src.info.name
    draft = repo_id or "PATH/TO/THIS/DIRECTORY"
    tags = ["speculative-decoding", "draft-model", family, f"format-{fmt}", "specheads", *engines]
    data = ModelCardData(
        base_model=target if looks_like_hub_id(target) else None,
        library_name="specheads",
        tags=tags,
        pipeline_tag="text-generation",
    )
    spec, info = src.spec, src.info
    what = head_class.describe(spec, info, src.layer_ids)
    body = [
        f"# {head_class.title} draft head for {target}",
        "",
        f"A speculative-decoding draft head for `{target}`: {what}. Written by specheads in the "
        f"`{fmt}` layout, checked against the loaders of: {', '.join(engines)}.",
        "",
    ]
    body += ["## Serve it", ""]
    for engine, command in serve_commands(src, fmt, engines, draft, target, num_speculative_tokens):
        body += [f"{engine}:", "", "```bash", command, "```", ""]
    body += [
        "Load it in specheads (any Hub id or local path):",
        "",
        "```bash",
        f'python infer.py model.path={target} head={draft} prompt="Hello"',
        "```",
        "",
    ]
    if bench_summary is not None:
        source = f" Source: `{bench_source}`." if bench_source else ""
        body += [
            "## Measured speed",
            "",
            "tau = generated tokens per target forward; speedups are tokens/s ratios against methods "
            f"run interleaved in the same process on the same questions.{source}",
            "",
            bench_table(bench_summary),
            "",
            *bench_context(bench_summary),
            "",
        ]
    training = src.config.get("training") or {}
    body += ["## Training", "", "Head config:", "", "```json", json.dumps(spec.to_dict(), indent=2), "```", ""]
    if training:
        body += ["Training run:", "", "```json", json.dumps(training, indent=2, default=str), "```", ""]
    body += [
        f"Target: `{info.name}` ({info.model_type}, {info.num_layers} layers, hidden {info.hidden_size}, "
        f"vocab {info.vocab_size}).",
        "",
    ]
    if notes:
        body += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))


def read_bench_summary(path: str | None) -> Any:
    if not path:
        return None
    p = Path(path)
    try:
        summary = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecHeadsError(f"bench.summary={path} is not a readable JSON file: {err}") from None
    return check_bench_summary(summary, f"bench.summary={path}")
