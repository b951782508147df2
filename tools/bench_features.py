"""Times the feature cache written by vLLM's extract_hidden_states against the transformers forward.

The same conversations (the first N of a distillation's training split, as distill.py splits it),
the same layers, dtype and shards, one sitting on one machine: first the transformers forward of the
target loaded here (TargetForward), then a vLLM server running extract_hidden_states (VLLMStates),
each writing a cache of its own; the two caches are compared state by state. Prints one JSON object
(tokens/s of each writer, its setup time apart: the target's load, the server's checks) and a
Markdown row for BENCHMARKS.md.

    # vLLM's CPU build here: the script starts a server for the embedded target and stops it
    .venv/bin/python tools/bench_features.py --data runs/distill --conversations 64 --serve
    # a running server (on a GPU machine, started as docs/training.md "Features from vLLM" says)
    python tools/bench_features.py --data runs/distill --model llama-3.1-8b --url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def model_config(name: str):
    """The ModelConfig distill.py composes with model=<name> (conf/model/<name>.yaml)."""
    from hydra import compose, initialize_config_dir

    from specheads.config import register_configs, typed

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return typed(compose(config_name="distill", overrides=[f"model={name}"])).model


def serve(args, extract: list[int], state: Path) -> tuple[str, list[str], dict]:
    """Start engines/vllm_serve.py with extract_hidden_states; (url, its command, its env)."""
    cmd = [sys.executable, str(ROOT / "engines" / "vllm_serve.py")]
    env = {**os.environ, "SPECHEADS_SERVE_STATE": str(state)}
    start = [*cmd, "start", "--port", str(args.port), "--extract-layers", ",".join(map(str, extract))]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*start, "--hidden-states-dir", str(state / "hidden_states")], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"vLLM did not start: {proc.stderr.strip()}")
    print(f"vLLM server up in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return proc.stdout.strip().splitlines()[-1], cmd, env


def timed(write) -> tuple[float, dict]:
    t0 = time.perf_counter()
    index = write()
    return time.perf_counter() - t0, index


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a distillation's output directory (distill.output)")
    p.add_argument("--model", default="smollm2-135m", help="conf/model/<name>.yaml (default: the embedded target)")
    p.add_argument("--conversations", type=int, default=32, help="the first N conversations of the training split")
    p.add_argument("--max-length", type=int, default=512, help="tokens per conversation (distill.features.max_length)")
    p.add_argument("--layers", type=int, nargs="*", help="cached layer ids (default: EAGLE-3's); the final state too")
    p.add_argument("--dtype", default="bfloat16", help="the cache's dtype")
    p.add_argument("--device", default="auto", help="where the transformers forward runs")
    p.add_argument("--url", help="a vLLM server running extract_hidden_states for these layers (+ L)")
    p.add_argument("--storage", help="with --url: the server's shared_storage_path as this machine sees it")
    p.add_argument("--serve", action="store_true", help="start one here with engines/vllm_serve.py (vLLM's CPU build)")
    p.add_argument("--port", type=int, default=8793)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight to the server")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if bool(args.url) == bool(args.serve):
        raise SystemExit("give one of --url URL and --serve")
    if args.url and not args.storage:
        raise SystemExit("--url needs --storage DIR: the server's shared_storage_path, where its dumps are read")

    import torch

    from specheads.config.distill import ServerConfig
    from specheads.config.train import DataConfig
    from specheads.data.datasets import build_datasets
    from specheads.data.features import FeatureCache, write_features
    from specheads.data.vllm_hidden_states import request_layer_ids
    from specheads.distill.vllm_features import VLLMStates, relative_error
    from specheads.heads.spec import default_layer_ids
    from specheads.target import load_target, resolve_device

    cfg = model_config(args.model)
    t0 = time.perf_counter()
    target = load_target(cfg, resolve_device(args.device))
    load_s = time.perf_counter() - t0
    layers = args.layers or default_layer_ids("eagle3", target.info.num_layers)
    data_cfg = DataConfig(name="distilled", path=args.data, max_length=args.max_length, decontaminate=[])
    train_rows, _ = build_datasets(data_cfg, target.tokenizer)
    rows = [train_rows[i] for i in range(min(args.conversations, len(train_rows)))]
    tokens = sum(min(len(r["input_ids"]), args.max_length) for r in rows)
    extract = request_layer_ids(layers, True, target.info.num_layers)
    work = Path(tempfile.mkdtemp(prefix="bench-features-"))
    stop = None
    if args.serve:
        url, cmd, env = serve(args, extract, work / "serve")
        storage = work / "serve" / "hidden_states"
        stop = lambda: subprocess.run([*cmd, "stop"], capture_output=True, text=True, env=env)  # noqa: E731
    else:
        url, storage = args.url, args.storage
    try:
        common = dict(max_length=args.max_length, dtype=args.dtype)
        hf_s, _ = timed(lambda: write_features(target, rows, layers, True, work / "hf", **common))
        t0 = time.perf_counter()
        source = VLLMStates(target, ServerConfig(url=url, concurrency=args.concurrency), layers, True, str(storage))
        check_s = time.perf_counter() - t0
        vllm_s, vllm_index = timed(
            lambda: write_features(target, rows, layers, True, work / "vllm", source=source, **common)
        )
        worst: dict[str, float] = {}
        hf_cache, vllm_cache = FeatureCache(work / "hf"), FeatureCache(work / "vllm")
        for i in range(len(hf_cache)):
            a, b = vllm_cache[i], hf_cache[i]
            for k, v in b.states.items():
                name = f"layer_{k}" if k != "final" else k
                worst[name] = max(worst.get(name, 0.0), relative_error(a.states[k], v))
    finally:
        if stop is not None:
            stop()
    result = {
        "model": args.model,
        "conversations": len(rows),
        "tokens": tokens,
        "layers": layers,
        "vllm_layer_ids": extract,
        "dtype": args.dtype,
        "transformers": {
            "device": str(target.device),
            "target_dtype": str(target.dtype).removeprefix("torch."),
            "load_s": round(load_s, 1),
            "write_s": round(hf_s, 2),
            "tokens_per_s": round(tokens / hf_s, 1),
        },
        "vllm": {
            "url": url,
            "version": vllm_index["writer"].get("vllm"),
            "check_s": round(check_s, 1),
            "write_s": round(vllm_s, 2),
            "tokens_per_s": round(tokens / vllm_s, 1),
        },
        "speedup": round(hf_s / vllm_s, 2),
        "max_relative_error": worst,
        "torch_threads": torch.get_num_threads(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    hf, vllm = result["transformers"], result["vllm"]
    print(
        f"| {args.model} | {len(rows)} conv / {tokens} tok | transformers {hf['tokens_per_s']} tok/s "
        f"| vLLM {vllm['version']} {vllm['tokens_per_s']} tok/s | {result['speedup']}x |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
