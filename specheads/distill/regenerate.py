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

import hashlib
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..atomic import write_text
from ..config.distill import DistillConfig
from ..data.decontaminate import build_index, resolve_eval_files
from ..data.shards import MANIFEST, METADATA, SHARDS, is_distill_output, read_manifest
from ..errors import SpecHeadsError
from .generation import generate
from .prompts import PromptFilter, dataset_prompts, end_of_turn_ids, follow_up_prompts, magpie_prompts, pad_token_id

PIPELINE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Output directory (read back by specheads.data.shards)


def write_shard(directory: Path, k: int, rows: list[dict]) -> Path:
    path = Path(directory) / SHARDS / f"shard-{k:05d}.jsonl"
    write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), fsync=True)
    return path


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary, merges and chat template (what the data's token ids depend on)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def specheads_version() -> str:
    from .. import __version__

    return __version__


# ---------------------------------------------------------------------------------------------
# Answering


def answer(
    target, conversations: list[list[dict]], cfg: DistillConfig, seed: int, desc: str | None = None
) -> list[tuple[str, bool]]:
    """The target's next assistant message for each conversation: (text, finished)."""
    tokenizer = target.tokenizer
    ids = [
        tokenizer(
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )["input_ids"]
        for c in conversations
    ]
    outs = generate(
        target.model,
        ids,
        max_new_tokens=cfg.max_new_tokens,
        stop_ids=end_of_turn_ids(tokenizer, target.model),
        pad_id=pad_token_id(tokenizer),
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        batch_size=cfg.batch_size,
        seed=seed,
        desc=desc,
    )
    return [(tokenizer.decode(o.tokens, skip_special_tokens=True), o.finished) for o in outs]


def converse(
    target, prompts: list[dict], cfg: DistillConfig, prompt_filter: PromptFilter, seed: int, desc: str = ""
) -> list[dict]:
    """Answer each prompt; for turns > 1 the target also writes follow-up user turns."""
    rows = [
        {"category": p["category"], "messages": [{"role": "user", "content": p["prompt"]}], "finished": True}
        for p in prompts
    ]
    active = list(range(len(rows)))
    for turn in range(cfg.turns):
        if turn > 0:
            follow = follow_up_prompts(
                target,
                [rows[i]["messages"] for i in active],
                cfg.magpie,
                prompt_filter,
                seed=_seed(seed, "follow", turn),
                batch_size=cfg.batch_size,
                desc=f"{desc} follow-ups turn {turn + 1}",
            )
            pairs = [(i, text) for i, text in zip(active, follow) if text is not None]
            for i, text in pairs:
                rows[i]["messages"].append({"role": "user", "content": text})
            active = [i for i, _ in pairs]
        replies = answer(
            target,
            [rows[i]["messages"] for i in active],
            cfg,
            seed=_seed(seed, "answer", turn),
            desc=f"{desc} answers turn {turn + 1}",
        )
        for i, (text, finished) in zip(active, replies):
            rows[i]["messages"].append({"role": "assistant", "content": text})
            rows[i]["finished"] = rows[i]["finished"] and finished
    return rows


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
        rows = converse(target, prompts, cfg, prompt_filter, seed=_seed(seed, "shard", k), desc=f"shard {k}")
        for i, row in enumerate(rows):
            row["id"] = f"{k:05d}-{i:05d}"
        if not is_distill_output(out):
            _write_metadata(out, target, cfg, seed, target_path, eval_files, fingerprint)
        path = write_shard(out, k, rows)
        rejected = {key: prompt_filter.counts[key] - before[key] for key in before}
        manifest["shards"][str(k)] = {"file": str(path.relative_to(out)), "rows": len(rows), "rejected": rejected}
        write_text(out / MANIFEST, json.dumps(manifest, indent=1))
        bar.update(size)
    bar.close()

    rows_total = sum(e["rows"] for e in manifest["shards"].values())
    rejected_total: dict[str, int] = {}
    for entry in manifest["shards"].values():
        for key, v in entry.get("rejected", {}).items():
            rejected_total[key] = rejected_total.get(key, 0) + v
    manifest.update(complete=True, conversations=rows_total, rejected=rejected_total)
    write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    _update_metadata(out, conversations=rows_total, rejected=rejected_total, complete=True)
    print(
        f"{out}: {rows_total} conversations in {num_shards} shard(s) "
        f"({time.time() - start:.0f} s this run); rejected prompts: {_nonzero(rejected_total)}; "
        f"decontamination dropped {rejected_total.get('contaminated', 0)}"
    )
    return out


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
    ]
    for ok, message in checks:
        if not ok:
            raise SpecHeadsError(message)


def _dataset_prompt_list(target, cfg: DistillConfig, prompt_filter: PromptFilter, seed: int) -> list[dict]:
    prompts = dataset_prompts(cfg.prompts, cfg.prompts_format, cfg.prompts_split)
    tokenizer = target.tokenizer
    kept = []
    for p in prompts:
        # Data set prompts are only deduplicated and checked for emptiness and contamination.
        if prompt_filter.accept(p["prompt"], quality=False):
            kept.append(p)
    kept = [
        p for p in kept if len(tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]) <= cfg.max_prompt_tokens
    ]
    random.Random(seed).shuffle(kept)
    if cfg.num_prompts is not None:
        kept = kept[: cfg.num_prompts]
    counts = prompt_filter.counts
    print(
        f"prompts from {cfg.prompts}: {len(prompts)} read, {counts['duplicate']} duplicates, "
        f"{counts['contaminated']} dropped by decontamination, {len(kept)} used"
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
        "pipeline_version": PIPELINE_VERSION,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return {"hash": digest, "settings": settings}


def _write_metadata(
    out: Path, target, cfg: DistillConfig, seed: int, target_path: str, eval_files, fingerprint: dict
) -> None:
    metadata = {
        "format": "openai-messages-jsonl",
        "data_files": f"{SHARDS}/*.jsonl",
        "specheads_version": specheads_version(),
        "pipeline_version": PIPELINE_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": {
            "name": target.info.name,
            "path": target_path,
            "revision": target.info.revision,
            "tokenizer": fingerprint["settings"]["tokenizer"],
        },
        "prompts": cfg.prompts,
        "answers": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "turns": cfg.turns,
        },
        "magpie": asdict(cfg.magpie),
        "seed": seed,
        "decontaminate": [str(f.resolve()) for f in eval_files],
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
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _nonzero(counts: dict) -> dict:
    return {k: v for k, v in counts.items() if v} or "none"
