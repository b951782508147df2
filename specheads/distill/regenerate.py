"""Self-distillation: the frozen target answers prompts; the conversations go to resumable shards.

Output directory:
    shards/shard-00000.jsonl   OpenAI "messages" rows, each shard written atomically
    manifest.json              the run's fingerprint and the completed shards (rewritten atomically)
    metadata.json              provenance: target, revision, sampling parameters, seed, version

Shard k holds the prompts of slot k, and every random choice is seeded by (seed, k), so running
the same command again skips the completed shards and produces the rest: no duplicates, no gaps.
Load the result with `datasets.load_dataset("json", data_files="DIR/shards/*.jsonl")` or
`specheads.data.formats.load_conversations("DIR")`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..atomic import write_bytes, write_text
from ..chat_template import chat_record, template_kwargs
from ..config.distill import DistillConfig
from ..data.decontaminate import build_index, resolve_eval_files
from ..data.shards import MANIFEST, METADATA, SHARDS, is_distill_output, read_manifest
from ..errors import SpecHeadsError
from ..provenance import provenance
from .backends import BACKENDS, make_backend
from .prompts import PromptFilter, dataset_prompts, follow_up_prompts, magpie_prompts

PIPELINE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Output directory (read back by specheads.data.shards)


def write_shard(directory: Path, k: int, rows: list[dict], compress: bool = False) -> Path:
    path = Path(directory) / SHARDS / f"shard-{k:05d}.jsonl{'.gz' if compress else ''}"
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if compress:  # mtime 0: the same rows give the same bytes (a shard committed twice does not change)
        write_bytes(path, gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0), fsync=True)
    else:
        write_text(path, text, fsync=True)
    return path


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary, merges, chat template and its variables (model.thinking): what the
    data's token ids depend on. Variables left at the template's defaults add nothing, so the
    fingerprints of data made before model.thinking existed stay what they were."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    if template_kwargs(tokenizer):
        h.update(json.dumps(template_kwargs(tokenizer), sort_keys=True).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Answering


def converse(
    target, backend, prompts: list[dict], cfg: DistillConfig, prompt_filter: PromptFilter, seed: int, desc: str = ""
) -> tuple[list[dict], dict]:
    """Answer each prompt; for turns > 1 the next user turn is the source's own (a data set's later
    user turn) or, where the source has none and the target is loaded here, one the target writes.
    Each user turn is answered given the target's own earlier answers. A turn the server refuses
    (over its context) ends its conversation before that turn, and a conversation refused at its
    first turn is dropped. Returns the rows and counts (answers, those cut off by max_new_tokens,
    tokens written, turns refused, source follow-ups over distill.max_prompt_tokens)."""
    rows = [
        {"category": p["category"], "messages": [{"role": "user", "content": p["prompt"]}], "finished": True}
        for p in prompts
    ]
    stats = {"answers": 0, "cut_off": 0, "tokens": 0, "refused_turns": 0, "follow_ups_too_long": 0}
    active = list(range(len(rows)))
    for turn in range(cfg.turns):
        if turn > 0:
            active = _next_user_turns(
                target, backend, prompts, rows, active, turn, cfg, prompt_filter, seed, desc, stats
            )
            if not active:
                break
        replies = backend.answer(
            [rows[i]["messages"] for i in active],
            seed=_seed(seed, "answer", turn),
            desc=f"{desc} answers turn {turn + 1}",
        )
        answered = []
        for i, reply in zip(active, replies):
            if reply is None:
                rows[i]["messages"].pop()  # the user turn it was asked
                stats["refused_turns"] += 1
                continue
            rows[i]["messages"].append({"role": "assistant", "content": reply.text})
            rows[i]["finished"] = rows[i]["finished"] and reply.finished
            stats["answers"] += 1
            stats["cut_off"] += int(not reply.finished)
            stats["tokens"] += reply.tokens
            answered.append(i)
        active = answered
    return [r for r in rows if r["messages"]], stats


def _next_user_turns(target, backend, prompts, rows, active, turn, cfg, prompt_filter, seed, desc, stats) -> list[int]:
    """Append turn `turn`'s user message where there is one; the rows that go on."""
    from_source = [i for i in active if "follow_ups" in prompts[i] and len(prompts[i]["follow_ups"]) >= turn]
    written = [i for i in active if "follow_ups" not in prompts[i] or not prompts[i]["follow_ups"]]
    going_on = []
    for i in from_source:
        text = prompts[i]["follow_ups"][turn - 1]
        # Real later turns ("continue", "thanks") repeat across conversations: no dedup, but
        # nothing empty and nothing from an evaluation set.
        if not text.strip() or (prompt_filter.index and prompt_filter.index.matches(text)):
            continue
        # as long as a first prompt may be (a pasted document would overrun a server's context)
        if len(target.tokenizer(text, add_special_tokens=False)["input_ids"]) > cfg.max_prompt_tokens:
            stats["follow_ups_too_long"] += 1
            continue
        rows[i]["messages"].append({"role": "user", "content": text})
        going_on.append(i)
    if written and backend.name == "hf":
        follow = follow_up_prompts(
            target,
            [rows[i]["messages"] for i in written],
            cfg.magpie,
            prompt_filter,
            seed=_seed(seed, "follow", turn),
            batch_size=cfg.batch_size,
            desc=f"{desc} follow-ups turn {turn + 1}",
        )
        for i, text in zip(written, follow):
            if text is not None:
                rows[i]["messages"].append({"role": "user", "content": text})
                going_on.append(i)
    return sorted(going_on)


def _seed(seed: int, *parts: Any) -> int:
    digest = hashlib.sha256(json.dumps([seed, *parts]).encode()).digest()
    return int.from_bytes(digest[:4], "little")


# ---------------------------------------------------------------------------------------------
# The run


def run_distillation(target, cfg: DistillConfig, seed: int = 0, target_path: str = "") -> Path:
    """Write (or finish) the distillation described by cfg into cfg.output; returns the directory."""
    out = Path(cfg.output).expanduser()
    _check(cfg)
    eval_files = resolve_eval_files(cfg.decontaminate)
    index = build_index(eval_files, cfg.ngram) if eval_files else None
    tokenizer = target.tokenizer
    magpie = cfg.prompts == "magpie"
    prompt_filter = PromptFilter(cfg.magpie, tokenizer, index)
    if magpie:
        if cfg.num_prompts is None:
            raise SpecHeadsError("distill.num_prompts must be set with distill.prompts=magpie")
        total, source = cfg.num_prompts, None
    else:
        source = _dataset_prompt_list(target, cfg, prompt_filter, seed)
        total = len(source)
    fingerprint = _fingerprint(target, cfg, seed, eval_files, source)

    manifest = read_manifest(out) if is_distill_output(out) else None
    if manifest is not None and manifest["fingerprint"] != fingerprint["hash"]:
        changed = sorted(k for k, v in fingerprint["settings"].items() if manifest.get("settings", {}).get(k) != v)
        raise SpecHeadsError(
            f"{out} holds a different distillation (changed: {', '.join(changed)}); use another distill.output"
        )
    if manifest is not None and manifest.get("complete"):
        print(f"{out}: distillation already complete ({manifest['conversations']} conversations)")
        return out

    num_shards = max(1, math.ceil(total / cfg.shard_size))
    if manifest is None:
        # Written with the first shard: a run that fails before it leaves nothing behind.
        manifest = {
            "fingerprint": fingerprint["hash"],
            "settings": fingerprint["settings"],
            "num_shards": num_shards,
            "shards": {},
            "complete": False,
        }

    def done(k: int) -> bool:
        entry = manifest["shards"].get(str(k))
        return entry is not None and (out / entry["file"]).is_file()

    # Completed shards' prompts count as seen, exactly as in an uninterrupted run.
    for k in range(num_shards):
        if done(k):
            for row in _read_jsonl(out / manifest["shards"][str(k)]["file"]):
                for m in row["messages"]:
                    if m["role"] == "user":
                        prompt_filter.add_seen(m["content"])

    backend = make_backend(target, cfg) if any(not done(k) for k in range(num_shards)) else None
    start = time.time()
    finished_rows = sum(e["rows"] for k, e in manifest["shards"].items() if done(int(k)))
    bar = tqdm(total=total, initial=finished_rows, desc="distill", unit="conv")
    for k in range(num_shards):
        if done(k):
            continue
        size = min(cfg.shard_size, total - k * cfg.shard_size)
        before = dict(prompt_filter.counts)
        if magpie:
            prompts = magpie_prompts(
                target,
                size,
                cfg.magpie,
                prompt_filter,
                seed=_seed(seed, "magpie", k),
                batch_size=cfg.batch_size,
                desc=f"shard {k} prompts",
            )
            if not prompts:
                raise SpecHeadsError(
                    f"the target wrote no usable prompt in {cfg.magpie.max_rounds} rounds "
                    f"(rejected: {_nonzero(prompt_filter.counts)}); relax distill.magpie filters "
                    "or give distill.prompts=FILE"
                )
        else:
            prompts = source[k * cfg.shard_size : (k + 1) * cfg.shard_size]
        shard_start = time.perf_counter()
        rows, stats = converse(
            target, backend, prompts, cfg, prompt_filter, seed=_seed(seed, "shard", k), desc=f"shard {k}"
        )
        stats["seconds"] = round(time.perf_counter() - shard_start, 2)
        for i, row in enumerate(rows):
            row["id"] = f"{k:05d}-{i:05d}"
        if not is_distill_output(out):
            _write_metadata(out, target, backend, cfg, seed, target_path, eval_files, fingerprint)
        path = write_shard(out, k, rows, compress=cfg.compress)
        rejected = {key: prompt_filter.counts[key] - before[key] for key in before}
        manifest["shards"][str(k)] = {
            "file": str(path.relative_to(out)),
            "rows": len(rows),
            "rejected": rejected,
            **stats,
        }
        manifest["generation"] = _generation_totals(manifest["shards"].values())  # so far, across resumes
        write_text(out / MANIFEST, json.dumps(manifest, indent=1))
        bar.update(size)
    bar.close()

    rows_total = sum(e["rows"] for e in manifest["shards"].values())
    rejected_total: dict[str, int] = {}
    for entry in manifest["shards"].values():
        for key, v in entry.get("rejected", {}).items():
            rejected_total[key] = rejected_total.get(key, 0) + v
    generation = _generation_totals(manifest["shards"].values())
    manifest.update(complete=True, conversations=rows_total, rejected=rejected_total, generation=generation)
    write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    _update_metadata(out, conversations=rows_total, rejected=rejected_total, generation=generation, complete=True)
    print(
        f"{out}: {rows_total} conversations in {num_shards} shard(s) "
        f"({time.time() - start:.0f} s this run); rejected prompts: {_nonzero(rejected_total)}; "
        f"decontamination dropped {rejected_total.get('contaminated', 0)}; {generation['answers']} answers, "
        f"{generation['cut_off_share']:.1%} cut off at {cfg.max_new_tokens} tokens, "
        f"{generation['tokens_per_s']} tokens/s; turns skipped: {generation['refused_turns']} refused by the "
        f"server, {generation['follow_ups_too_long']} follow-ups over {cfg.max_prompt_tokens} tokens"
    )
    return out


def _generation_totals(shards) -> dict:
    """Answers, the share cut off by max_new_tokens, tokens and time over the shards (any run)."""
    shards = list(shards)
    answers = sum(e.get("answers", 0) for e in shards)
    tokens = sum(e.get("tokens", 0) for e in shards)
    seconds = sum(e.get("seconds", 0.0) for e in shards)
    return {
        "answers": answers,
        "refused_turns": sum(e.get("refused_turns", 0) for e in shards),
        "follow_ups_too_long": sum(e.get("follow_ups_too_long", 0) for e in shards),
        "cut_off": sum(e.get("cut_off", 0) for e in shards),
        "cut_off_share": round(sum(e.get("cut_off", 0) for e in shards) / max(answers, 1), 4),
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
    }


def _check(cfg: DistillConfig) -> None:
    checks = [
        (cfg.turns >= 1, "distill.turns must be >= 1"),
        (cfg.batch_size >= 1, "distill.batch_size must be >= 1"),
        (cfg.shard_size >= 1, "distill.shard_size must be >= 1"),
        (cfg.max_new_tokens >= 1, "distill.max_new_tokens must be >= 1"),
        (cfg.num_prompts is None or cfg.num_prompts >= 1, "distill.num_prompts must be >= 1"),
        (0.0 < cfg.top_p <= 1.0, "distill.top_p must be in (0, 1]"),
        (0.0 < cfg.magpie.top_p <= 1.0, "distill.magpie.top_p must be in (0, 1]"),
        (cfg.magpie.cut in ("trim", "drop", "keep"), "distill.magpie.cut must be trim, drop or keep"),
        (cfg.temperature >= 0.0, "distill.temperature must be >= 0"),
        (cfg.backend in BACKENDS, f"unknown distill.backend={cfg.backend!r}; use one of {list(BACKENDS)}"),
        (
            cfg.backend == "hf" or cfg.prompts != "magpie",
            "distill.backend=server answers prompts from a data set; the target writes Magpie prompts only "
            "when loaded here (distill.backend=hf), or give distill.prompts=sharegpt or a prompt file",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise SpecHeadsError(message)


def _dataset_prompt_list(target, cfg: DistillConfig, prompt_filter: PromptFilter, seed: int) -> list[dict]:
    """The data set's prompts that get answered: not empty, not seen before, not from an evaluation
    set, and short enough (distill.max_prompt_tokens); shuffled by the seed, then cut to num_prompts."""
    prompts = dataset_prompts(cfg.prompts, cfg.prompts_format, cfg.prompts_split)
    tokenizer = target.tokenizer
    kept, too_long = [], 0
    for p in prompts:
        # Data set prompts are only deduplicated and checked for emptiness and contamination.
        if not prompt_filter.accept(p["prompt"], quality=False):
            continue
        if len(tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]) > cfg.max_prompt_tokens:
            too_long += 1
            continue
        kept.append(p)
    random.Random(seed).shuffle(kept)
    if cfg.num_prompts is not None:
        kept = kept[: cfg.num_prompts]
    counts = prompt_filter.counts
    print(
        f"prompts from {cfg.prompts}: {len(prompts)} read, {counts['empty_or_cut']} empty, "
        f"{counts['duplicate']} duplicates, {counts['contaminated']} dropped by decontamination, "
        f"{too_long} over {cfg.max_prompt_tokens} tokens, {len(kept)} used"
    )
    # Those counts describe the source, not a shard: reset so shards report their own.
    prompt_filter.counts = {k: 0 for k in counts}
    if not kept:
        raise SpecHeadsError(f"no usable prompt in {cfg.prompts}")
    return kept


def _fingerprint(target, cfg: DistillConfig, seed: int, eval_files, source) -> dict:
    prompts_digest = None
    if source is not None:  # the prompts actually used, so an edited prompt file is noticed
        prompts_digest = hashlib.sha256(json.dumps(source).encode()).hexdigest()[:16]
    settings = {
        "target": target.info.name,
        "revision": target.info.revision,
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "prompts": cfg.prompts,
        "prompts_format": cfg.prompts_format,
        "prompts_split": cfg.prompts_split,
        "prompts_digest": prompts_digest,
        "num_prompts": cfg.num_prompts,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "turns": cfg.turns,
        "shard_size": cfg.shard_size,
        "seed": seed,
        "magpie": asdict(cfg.magpie) if cfg.prompts == "magpie" or cfg.turns > 1 else None,
        "decontaminate": sorted(f.name for f in eval_files),
        "ngram": cfg.ngram,
        "backend": cfg.backend,
        "compress": cfg.compress,
        "pipeline_version": PIPELINE_VERSION,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return {"hash": digest, "settings": settings}


def _write_metadata(
    out: Path, target, backend, cfg: DistillConfig, seed: int, target_path: str, eval_files, fingerprint: dict
) -> None:
    metadata = {
        "format": "openai-messages-jsonl",
        "data_files": f"{SHARDS}/*.jsonl{'.gz' if cfg.compress else ''}",
        **provenance(),
        "pipeline_version": PIPELINE_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": {
            "name": target.info.name,
            "path": target_path,
            "revision": target.info.revision,
            "tokenizer": fingerprint["settings"]["tokenizer"],
            # the chat template and model.thinking the answers were written with (train.py checks it)
            "chat": chat_record(target.tokenizer),
        },
        "prompts": cfg.prompts,
        **backend.describe(),
        "answers": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "turns": cfg.turns,
        },
        "magpie": asdict(cfg.magpie),
        "seed": seed,
        # names and digests: an absolute path would name one machine's files
        "decontaminate": [{"file": f.name, "sha256": _file_digest(f)} for f in eval_files],
        "ngram": cfg.ngram,
        "fingerprint": fingerprint["hash"],
        "complete": False,
    }
    write_text(out / METADATA, json.dumps(metadata, indent=1))


def _update_metadata(out: Path, **fields) -> None:
    path = out / METADATA
    metadata = json.loads(path.read_text()) if path.is_file() else {}
    metadata.update(fields)
    write_text(path, json.dumps(metadata, indent=1))


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _nonzero(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if v} or "none"
