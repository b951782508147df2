"""Run exported draft heads in vLLM's CPU build, next to vLLM's own plain greedy decoding.

    .venv-vllm/bin/python engines/vllm_run.py SPEC.json OUT.json

Needs only the standard library and vllm: it runs in vLLM's own virtualenv (`make engines`), whose
torch and transformers pins differ from the project's. SPEC.json:

    {"target": DIR, "prompts": [[token ids], ...], "max_new_tokens": N, "batch": 8,
     "runs": [{"name": "plain", "speculative_config": null},
              {"name": "eagle3", "speculative_config": {"method": "eagle3", "model": DIR, ...}}]}

OUT.json maps each run name to {loaded, error, output_ids, batch_output_ids, tokens_per_s_batch1,
request_s, tokens_per_s_batch, spec}; spec holds vLLM's spec-decode counters over the batch-1 pass. OUT.json
is rewritten (atomically) after every run, so a crash keeps the runs before it.

Optional: "warmup_prompt" (token ids; default the first prompt) is the request that warms the
engine before timing, and a run with "fresh_engine_per_pass": true gets a new engine for the
batched pass: a drafter that remembers earlier answers (Suffix Decoding's global tree) would
otherwise be timed on answers it has already seen.
"""

import gc
import json
import os
import sys
import time

# Engine settings measured to work for SmolLM2-135M on a 2-core CPU (../shared/reference/vllm_cpu.md).
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "seed": 0}
SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}


def write_json(path, data):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def spec_counters(llm):
    """vLLM's cumulative spec-decode counters (summed over label sets; per-position as a list)."""
    out = {}
    for m in llm.get_metrics():
        key = SPEC_METRICS.get(m.name)
        if key is None:
            continue
        if key == "accepted_per_pos":
            values = list(getattr(m, "values", []))
            prev = out.get(key, [0] * len(values))
            out[key] = [a + b for a, b in zip(prev, values)] if prev else values
        else:
            out[key] = out.get(key, 0) + int(getattr(m, "value", 0))
    return out


def delta(after, before):
    out = {}
    for key, value in after.items():
        if isinstance(value, list):
            prev = before.get(key) or [0] * len(value)
            out[key] = [a - b for a, b in zip(value, prev)]
        else:
            out[key] = value - before.get(key, 0)
    return out


def first_line(err):
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".strip()


def run_one(spec, run):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    warmup = TokensPrompt(prompt_token_ids=spec.get("warmup_prompt") or spec["prompts"][0])
    kwargs = dict(ENGINE, model=spec["target"], disable_log_stats=False)
    if run.get("speculative_config"):
        kwargs["speculative_config"] = run["speculative_config"]

    def start():
        engine = LLM(**kwargs)
        engine.generate([warmup], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        return engine

    try:
        llm = start()
    except Exception as err:  # an engine that cannot load the head: report it, go on with the others
        return {"loaded": False, "error": first_line(err)}
    try:
        before = spec_counters(llm)
        outputs, tokens, request_s = [], 0, []
        for p in prompts:  # batch 1: one request at a time
            t0 = time.perf_counter()
            res = llm.generate([p], params, use_tqdm=False)
            request_s.append(time.perf_counter() - t0)
            ids = list(res[0].outputs[0].token_ids)
            outputs.append(ids)
            tokens += len(ids)
        counters = delta(spec_counters(llm), before)
        if run.get("fresh_engine_per_pass"):
            llm = None
            gc.collect()
            llm = start()
        batch = [prompts[i % len(prompts)] for i in range(spec["batch"])]
        t0 = time.perf_counter()
        res = llm.generate(batch, params, use_tqdm=False)
        batch_wall = time.perf_counter() - t0
        batch_ids = [list(r.outputs[0].token_ids) for r in res]
        return {
            "loaded": True,
            "error": None,
            "output_ids": outputs,
            "batch_output_ids": batch_ids,
            "tokens_per_s_batch1": tokens / sum(request_s) if sum(request_s) else 0.0,
            "request_s": request_s,  # each batch-1 request's wall time, in order
            "tokens_per_s_batch": sum(map(len, batch_ids)) / batch_wall if batch_wall else 0.0,
            "batch": spec["batch"],
            "spec": counters if run.get("speculative_config") else None,
        }
    except Exception as err:
        return {"loaded": True, "error": first_line(err)}
    finally:
        llm = None  # the engine (and its worker process) goes before the next run starts one
        gc.collect()


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: vllm_run.py SPEC.json OUT.json")
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    results = {}
    for run in spec["runs"]:
        print(f"vllm_run: {run['name']}", file=sys.stderr, flush=True)
        results[run["name"]] = run_one(spec, run)
        write_json(argv[2], results)
        print(f"vllm_run: {run['name']} done", file=sys.stderr, flush=True)


if __name__ == "__main__":  # vLLM may start its engine with spawn, which re-imports this file
    main(sys.argv)
