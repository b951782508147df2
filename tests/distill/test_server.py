"""distill.backend=server against a local OpenAI-compatible server (loopback only).

The server here answers with the tiny target's own greedy loop, so a distillation through it must
equal one through distill.backend=hf row for row; its /v1/completions returns the identity probe's
next-token log-probabilities of the weights it serves (the target's, or another seed's); it can also
fail on request, serve other models, lack /tokenize or log-probabilities. The real vLLM server is
exercised by the `engines` test at the end.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import thinking_target, write_questions
from json_server import NOT_FOUND, JsonServer, chat_ids

from specheads.chat_template import CHAT_KWARGS, apply_chat
from specheads.config.distill import DistillConfig, ServerConfig
from specheads.distill.backends import HFBackend
from specheads.distill.regenerate import run_distillation
from specheads.errors import SpecHeadsError

ROOT = Path(__file__).resolve().parents[2]


class FakeServer(JsonServer):
    """/v1/models, /tokenize, /v1/chat/completions and /v1/completions (the identity probe's next-token
    log-probabilities, as vLLM returns them, or as llama.cpp does) over a tiny target, with failure knobs."""

    def __init__(
        self,
        target,
        cfg: DistillConfig,
        models=("tiny",),
        tokenize=True,
        fail_at=None,
        shift=0,
        max_context=None,
        logprobs=True,
        token_prompts=True,
    ):
        self.target, self.models, self.tokenize, self.fail_at, self.shift = (
            target,
            list(models),
            tokenize,
            fail_at,
            shift,
        )
        self.max_context = max_context  # vLLM's 400 for a prompt and max_tokens over the served context
        self.logprobs = logprobs  # False: a server that answers completions without log-probabilities
        self.token_prompts = token_prompts  # False: a server that takes text prompts only
        self.backend = HFBackend(target, replace(cfg, batch_size=1))
        self.requests = 0
        self.probes = []
        self.bodies = []
        self.lock = threading.Lock()
        self.start()

    def get(self, path):
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        return NOT_FOUND

    def post(self, path, body):
        if path == "/tokenize" and self.tokenize == "llama.cpp" and "content" not in body:
            return 200, {"tokens": []}  # llama.cpp's server reads "content" only
        if path == "/tokenize" and self.tokenize:
            ids = chat_ids(self.target, body["messages"], self.shift, body.get("chat_template_kwargs"))
            return 200, {"tokens": ids, "count": len(ids)}
        if path == "/v1/chat/completions":
            return self.complete(body)
        if path == "/v1/completions":
            return self.next_token(body)
        return NOT_FOUND

    def complete(self, body):
        with self.lock, self.rendering(body):
            self.requests += 1
            self.bodies.append(body)
            if self.fail_at is not None and self.requests >= self.fail_at:
                return 500, {"error": {"message": "engine died", "type": "InternalServerError"}}
            if body["model"] not in self.models:
                return 404, {"error": {"message": f"model {body['model']} not found"}}
            asked = len(self.prompt_ids(body["messages"])) + body["max_tokens"]
            if self.max_context is not None and asked > self.max_context:
                message = (
                    f"This model's maximum context length is {self.max_context} tokens. However, you requested {asked}"
                )
                return 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
            backend = replace(self.backend.cfg, max_new_tokens=body["max_tokens"])
            [answer] = HFBackend(self.target, backend).answer([body["messages"]], seed=0)
            prompt = self.prompt_ids(body["messages"])
        return 200, {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer.text},
                    "finish_reason": "stop" if answer.finished else "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt) + self.shift,
                "completion_tokens": answer.tokens,
                "total_tokens": len(prompt) + answer.tokens,
            },
        }

    def next_token(self, body):
        """A completion of max_tokens=1 with the top `logprobs` log-probabilities of the served weights."""
        tokenizer = self.target.tokenizer
        prompt = body["prompt"]
        if isinstance(prompt, list) and not self.token_prompts:
            return 400, {"error": {"message": "prompt must be a string", "type": "BadRequestError", "code": 400}}
        ids = prompt if isinstance(prompt, list) else tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with self.lock:
            self.probes.append(body)
            with torch.no_grad():
                logits = self.target.model(input_ids=torch.tensor([ids])).logits[0, -1]
        top = torch.topk(torch.log_softmax(logits.float(), -1), int(body.get("logprobs") or 1))
        pairs = [(int(i), float(v)) for i, v in zip(top.indices, top.values)]

        def name(i):  # vLLM: the token's text, or "token_id:N" when asked
            return f"token_id:{i}" if body.get("return_tokens_as_token_ids") else tokenizer.decode([i])

        if not self.logprobs or body.get("logprobs") is None:
            logprobs = None
        elif self.tokenize == "llama.cpp":
            logprobs = {
                "content": [
                    {
                        "id": pairs[0][0],
                        "token": tokenizer.decode([pairs[0][0]]),
                        "logprob": pairs[0][1],
                        "top_logprobs": [{"id": i, "token": tokenizer.decode([i]), "logprob": v} for i, v in pairs],
                    }
                ]
            }
        else:
            logprobs = {
                "tokens": [name(pairs[0][0])],
                "token_logprobs": [pairs[0][1]],
                "top_logprobs": [{name(i): v for i, v in pairs}],
                "text_offset": [0],
            }
        choice = {"index": 0, "text": tokenizer.decode([pairs[0][0]]), "logprobs": logprobs, "finish_reason": "length"}
        usage = {"prompt_tokens": len(ids) + self.shift, "completion_tokens": 1, "total_tokens": len(ids) + 1}
        return 200, {
            "id": "c",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [choice],
            "usage": usage,
        }

    def prompt_ids(self, messages):
        prompt = apply_chat(self.target.tokenizer, messages, add_generation_prompt=True, tokenize=True)
        return list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)

    @contextlib.contextmanager
    def rendering(self, body):
        """The served tokenizer renders with the request's chat_template_kwargs (vLLM's and SGLang's
        field), its template's defaults without; under self.lock, so one request at a time."""
        tokenizer, kwargs = self.target.tokenizer, body.get("chat_template_kwargs")
        if not kwargs:
            yield
            return
        before = getattr(tokenizer, CHAT_KWARGS, None)
        setattr(tokenizer, CHAT_KWARGS, dict(kwargs))
        try:
            yield
        finally:
            setattr(tokenizer, CHAT_KWARGS, before)


def cfg(tmp_path, name, **kw):
    prompts = write_questions(tmp_path / "q.jsonl", ["Tell me a joke.", "What is rain?", "Name a color.", "Why?"])
    base = dict(
        prompts=str(prompts),
        num_prompts=None,
        max_new_tokens=6,
        shard_size=2,
        batch_size=4,
        output=str(tmp_path / name),
    )
    base.update(kw)
    return DistillConfig(**base)


def shard_rows(out):
    rows = []
    for f in sorted((Path(out) / "shards").glob("*.jsonl*")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def server_cfg(base: DistillConfig, url, **kw):
    return replace(base, backend="server", server=ServerConfig(url=url, retries=0, **kw))


@pytest.fixture
def server(tiny_target, tmp_path):
    servers = []

    def start(served=None, **kw):
        s = FakeServer(served or tiny_target, cfg(tmp_path, "unused"), **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()


def test_server_answers_equal_the_loaded_targets(tiny_target, tmp_path, server):
    ref = shard_rows(run_distillation(tiny_target, cfg(tmp_path, "hf")))
    fake = server()
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "srv"), fake.url, concurrency=3))
    assert shard_rows(out) == ref
    assert fake.requests == 4
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["backend"] == "server" and meta["server"]["model"] == "tiny"
    # the target is loaded here (identity=auto): its weights were compared, and its tokenizer
    assert meta["server"]["check"] == "logprobs" and meta["server"]["identity"] == "auto"
    assert meta["server"]["logprobs"]["max_abs_diff"] <= 1e-6 and meta["server"]["logprobs"]["compared"] == 5
    assert meta["server"]["tokenizer_check"].startswith("tokenize")
    assert len(fake.probes) == 1 and fake.probes[0]["max_tokens"] == 1 and fake.probes[0]["temperature"] == 0.0
    assert isinstance(fake.probes[0]["prompt"], list)  # the probe's token ids, as the target reads them
    generation = json.loads((out / "manifest.json").read_text())["generation"]
    assert generation["answers"] == 4 and generation["tokens"] > 0
    assert generation["cut_off"] == sum(not r["finished"] for r in ref)


def test_every_greedy_sampling_field_is_pinned_and_recorded(tiny_target, tmp_path, server):
    """vLLM fills the fields a request leaves out from the served model's generation_config.json
    (a repetition penalty, top_k, ...): greedy answers would not be the target's. Every request
    names them all, and the metadata records what was sent."""
    fake = server()
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "srv"), fake.url))
    pinned = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert fake.bodies and all({k: b.get(k) for k in pinned} == pinned for b in fake.bodies)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["server"]["sampling"] == pinned


def test_the_thinking_setting_travels_in_every_chat_request(tmp_path, server):
    """model.thinking reaches the server as chat_template_kwargs (vLLM's and SGLang's field), so the
    served model renders as the target does here and answers as distill.backend=hf; a request
    without it renders with the template's default (the identity probe's encoding differs). Left
    unset, no request carries the field."""
    off = thinking_target(False)
    fake = server(served=thinking_target(None))  # the server's own tokenizer: the template's defaults
    out = run_distillation(off, server_cfg(cfg(tmp_path, "srv"), fake.url))
    assert shard_rows(out) == shard_rows(run_distillation(off, cfg(tmp_path, "hf")))
    assert fake.bodies and all(b["chat_template_kwargs"] == {"enable_thinking": False} for b in fake.bodies)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["server"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert meta["target"]["chat"]["thinking"] is False
    default = server(served=thinking_target(None))
    run_distillation(thinking_target(None), server_cfg(cfg(tmp_path, "default"), default.url))
    assert default.bodies and not any("chat_template_kwargs" in b for b in default.bodies)


def test_unreachable_server_is_one_line_and_writes_nothing(tiny_target, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = server_cfg(cfg(tmp_path, "out"), f"http://127.0.0.1:{port}/v1")
    with pytest.raises(SpecHeadsError, match="cannot connect") as err:
        run_distillation(tiny_target, run)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_http_error_mid_run_keeps_whole_shards_and_a_rerun_resumes(tiny_target, tmp_path, server):
    ref = shard_rows(run_distillation(tiny_target, cfg(tmp_path, "hf")))
    failing = server(fail_at=3)  # the first shard's 2 answers succeed, then every request fails
    run = server_cfg(cfg(tmp_path, "out"), failing.url)
    with pytest.raises(SpecHeadsError, match="HTTP 500") as err:
        run_distillation(tiny_target, run)
    assert "\n" not in str(err.value)
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["shards"]) == ["0"] and not manifest["complete"]
    assert manifest["generation"]["answers"] == 2  # running totals of the finished shards
    assert [p.name for p in (out / "shards").iterdir()] == ["shard-00000.jsonl"]  # no half shard
    healthy = server()
    assert shard_rows(run_distillation(tiny_target, server_cfg(cfg(tmp_path, "out"), healthy.url))) == ref
    assert healthy.requests == 2  # only the missing shard was asked for


def test_an_over_long_or_refused_turn_is_skipped_and_counted_not_fatal(tiny_target, tmp_path, server):
    """A follow-up turn over distill.max_prompt_tokens is not sent; a turn the server refuses (HTTP 400:
    over its context) ends its conversation before that turn, and a conversation refused at its first
    turn is dropped; each is counted, and the run goes on to the end."""
    from conftest import write_jsonl

    questions = [
        {"question_id": 0, "category": "c", "turns": ["What is rain?", "Say more."]},
        {"question_id": 1, "category": "c", "turns": ["Name a color.", "more " * 60]},  # a long follow-up
        {"question_id": 2, "category": "c", "turns": ["tell " * 40, "Why?"]},  # a long first prompt
        {"question_id": 3, "category": "c", "turns": ["Why?", "Then?"]},
    ]
    prompts = write_jsonl(tmp_path / "turns.jsonl", questions)
    base = replace(cfg(tmp_path, "unused"), prompts=str(prompts), turns=2, max_prompt_tokens=1000)
    limited = server(max_context=150)
    out = run_distillation(tiny_target, server_cfg(replace(base, output=str(tmp_path / "a")), limited.url))
    rows = {r["messages"][0]["content"]: r["messages"] for r in shard_rows(out)}
    assert set(rows) == {"What is rain?", "Name a color.", "Why?"}  # the long first prompt was refused
    assert [len(rows[p]) for p in ("What is rain?", "Name a color.", "Why?")] == [4, 2, 4]
    generation = json.loads((out / "manifest.json").read_text())["generation"]
    assert generation["refused_turns"] == 2 and generation["follow_ups_too_long"] == 0
    # the same follow-up over max_prompt_tokens is not sent at all
    short = replace(base, output=str(tmp_path / "b"), max_prompt_tokens=100)
    out = run_distillation(tiny_target, server_cfg(short, server().url))
    rows = {r["messages"][0]["content"]: r["messages"] for r in shard_rows(out)}
    assert len(rows["Name a color."]) == 2 and len(rows["What is rain?"]) == 4
    generation = json.loads((out / "manifest.json").read_text())["generation"]
    assert generation["follow_ups_too_long"] == 1 and generation["refused_turns"] == 0


def test_a_server_serving_another_model_is_refused(tiny_target, tmp_path, server):
    other = server(shift=1)  # another tokenizer: the probe encodes differently
    with pytest.raises(SpecHeadsError, match="not the target model=tiny-random.*encode a probe differently"):
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "a"), other.url))
    assert other.requests == 0
    # no /tokenize: the prompt's token count is what can be compared
    counting = server(tokenize=False, shift=2)
    with pytest.raises(SpecHeadsError, match="counts .* prompt tokens in a probe"):
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "b"), counting.url))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    same = server(tokenize=False)
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "c"), same.url))
    assert json.loads((out / "metadata.json").read_text())["server"]["tokenizer_check"].startswith("prompt_tokens")


def other_seed(tiny_target):
    """The tiny target's architecture and tokenizer with other weights: another model of the same family."""
    from specheads.target import FrozenTarget
    from specheads.tiny import tiny_target as build

    model, tokenizer = build("llama", seed=1)
    return FrozenTarget(model, tokenizer, name="tiny-random-seed1")


def test_a_server_serving_the_same_family_with_other_weights_is_refused(tiny_target, tmp_path, server):
    """Same tokenizer and chat template, other weights: the tokenizer check alone accepts it (and the
    code before identity=logprobs did, saying the identity was checked); the log-probabilities of the
    identity probe refuse it in one line naming both."""
    other = server(served=other_seed(tiny_target))
    with pytest.raises(SpecHeadsError, match=r"serves 'tiny', which is not the target model=tiny-random: ") as err:
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "a"), other.url))
    assert "\n" not in str(err.value) and "identity probe" in str(err.value)
    assert other.requests == 0 and not (tmp_path / "a").exists()
    # identity=logprobs says the same; identity=tokenizer accepts it and records that only the tokenizer was checked
    with pytest.raises(SpecHeadsError, match="not the target model=tiny-random"):
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "b"), other.url, identity="logprobs"))
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "c"), other.url, identity="tokenizer"))
    meta = json.loads((out / "metadata.json").read_text())["server"]
    assert meta["check"] == "tokenizer" and "logprobs" not in meta and meta["identity"] == "tokenizer"


def test_a_server_without_logprobs_is_refused_under_identity_logprobs(tiny_target, tmp_path, server):
    silent = server(logprobs=False)
    for identity in ("logprobs", "auto"):  # auto: the tiny target is loaded here, so logprobs
        with pytest.raises(SpecHeadsError, match="returned no log-probabilities .*identity=tokenizer") as err:
            run_distillation(tiny_target, server_cfg(cfg(tmp_path, identity), silent.url, identity=identity))
        assert "\n" not in str(err.value)
    assert silent.requests == 0
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "tok"), silent.url, identity="tokenizer"))
    assert json.loads((out / "metadata.json").read_text())["server"]["check"] == "tokenizer"
    with pytest.raises(SpecHeadsError, match="unknown distill.server.identity='weights'"):
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "x"), silent.url, identity="weights"))


def test_a_server_taking_text_prompts_only_is_probed_with_the_text(tiny_target, tmp_path, server):
    text_only = server(token_prompts=False)
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "a"), text_only.url, identity="logprobs"))
    meta = json.loads((out / "metadata.json").read_text())["server"]
    assert meta["check"] == "logprobs" and meta["logprobs"]["prompt_as"] == "text"
    assert [isinstance(b["prompt"], str) for b in text_only.probes] == [True]


def test_auto_loads_a_target_that_fits_and_warns_when_it_does_not(tiny_target, tmp_path, server, monkeypatch, capsys):
    """A server run reads only the target's tokenizer (distill.py); identity=auto loads its weights for
    the comparison when their files total under a quarter of this machine's memory, else checks the
    tokenizer only and says so in one line on stderr."""
    from specheads.config.model import ModelConfig
    from specheads.distill import identity
    from specheads.distill.backends import load_tokenizer_target

    saved = tmp_path / "target"
    tiny_target.model.save_pretrained(saved)
    tiny_target.tokenizer.save_pretrained(saved)
    target = load_tokenizer_target(ModelConfig(name="tiny-random", path=str(saved)))
    assert target.model is None
    size, _ = identity.weight_bytes(target.source)
    assert size == sum(p.stat().st_size for p in saved.glob("*.safetensors"))
    fake = server()
    out = run_distillation(target, server_cfg(cfg(tmp_path, "fits"), fake.url))
    meta = json.loads((out / "metadata.json").read_text())["server"]
    assert meta["check"] == "logprobs" and meta["logprobs"]["max_abs_diff"] <= 1e-5
    capsys.readouterr()
    monkeypatch.setattr(identity, "machine_ram", lambda: 4 * size)  # a quarter of it is not more than the weights
    out = run_distillation(target, server_cfg(cfg(tmp_path, "large"), fake.url))
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "not compared" in warning[0] and "quarter of this machine" in warning[0]
    meta = json.loads((out / "metadata.json").read_text())["server"]
    assert meta["check"] == "tokenizer" and "logprobs" not in meta and "quarter" in meta["weights_not_compared"]
    assert len(fake.probes) == 1  # the log-probabilities were asked for in the first run only


def test_llama_cpp_serving_the_target_is_accepted(tiny_target, tmp_path, server):
    """llama.cpp's /tokenize answers a body without "content" with an empty token list: that is no
    answer about the chat template, not another tokenizer; the prompt's token count is compared."""
    llama = server(tokenize="llama.cpp")
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "a"), llama.url))
    meta = json.loads((out / "metadata.json").read_text())["server"]
    assert meta["tokenizer_check"].startswith("prompt_tokens")
    assert meta["check"] == "logprobs" and meta["logprobs"]["max_abs_diff"] <= 1e-6  # llama.cpp's logprobs format
    other = server(tokenize="llama.cpp", shift=2)
    with pytest.raises(SpecHeadsError, match="counts .* prompt tokens in a probe"):
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "b"), other.url))


def test_picking_the_served_model(tiny_target, tmp_path, server):
    several = server(models=("tiny", "big"))
    with pytest.raises(SpecHeadsError, match="serves 2 models .*distill.server.model="):
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "a"), several.url))
    with pytest.raises(SpecHeadsError, match="does not serve 'huge'"):
        run_distillation(tiny_target, server_cfg(cfg(tmp_path, "b"), several.url, model="huge"))
    out = run_distillation(tiny_target, server_cfg(cfg(tmp_path, "c"), several.url, model="tiny"))
    assert json.loads((out / "metadata.json").read_text())["server"]["model"] == "tiny"


def test_server_backend_refuses_magpie_and_a_missing_url(tiny_target, tmp_path):
    with pytest.raises(SpecHeadsError, match="Magpie"):
        run_distillation(tiny_target, replace(cfg(tmp_path, "a"), prompts="magpie", num_prompts=2, backend="server"))
    with pytest.raises(SpecHeadsError, match="distill.server.url="):
        run_distillation(tiny_target, replace(cfg(tmp_path, "b"), backend="server"))


def test_compressed_shards_read_back_like_plain_ones(tiny_target, tmp_path):
    from specheads.data.formats import load_conversations

    plain = run_distillation(tiny_target, cfg(tmp_path, "plain"))
    packed = run_distillation(tiny_target, cfg(tmp_path, "packed", compress=True))
    assert sorted(p.name for p in (packed / "shards").iterdir()) == ["shard-00000.jsonl.gz", "shard-00001.jsonl.gz"]
    assert load_conversations(str(packed)) == load_conversations(str(plain))
    assert shard_rows(plain) == [json.loads(x) for x in _gunzip_lines(packed)]


def _gunzip_lines(out):
    import gzip

    lines = []
    for f in sorted((out / "shards").iterdir()):
        lines += gzip.decompress(f.read_bytes()).decode().splitlines()
    return lines


def test_distill_cli_unreachable_server_is_one_line(tmp_path):
    prompts = write_questions(tmp_path / "q.jsonl", ["Hi there"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "distill.py"),
            "model=tiny-random",
            f"distill.prompts={prompts}",
            "distill.backend=server",
            "distill.server.url=http://127.0.0.1:9/v1",
            "distill.server.retries=0",
            f"distill.output={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "cannot connect" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.engines
def test_a_real_vllm_server_writes_the_data(tmp_path):
    """The embedded target served by vLLM's CPU build (make serve's script) answers a few prompts,
    each as the target loaded here answers it (fp32 greedy on both sides), after identity=logprobs
    compared vLLM's next-token log-probabilities of the probe with the target's."""
    vllm_python = ROOT / ".venv-vllm" / "bin" / "python"
    if not vllm_python.is_file():
        pytest.skip(".venv-vllm is missing: make .venv-vllm/.installed")
    port = 8790
    serve = [sys.executable, str(ROOT / "engines" / "vllm_serve.py")]
    env = {**os.environ, "SPECHEADS_SERVE_STATE": str(tmp_path / "serve")}
    started = subprocess.run([*serve, "start", "--port", str(port)], capture_output=True, text=True, env=env)
    assert started.returncode == 0, started.stderr
    try:
        url = started.stdout.strip().splitlines()[-1]
        prompts = write_questions(tmp_path / "q.jsonl", ["Name three colors.", "What is rain?", "Say hello."])
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "distill.py"),
                f"distill.prompts={prompts}",
                "distill.backend=server",
                f"distill.server.url={url}",
                "distill.server.identity=logprobs",
                "distill.max_new_tokens=32",
                "distill.num_prompts=null",
                f"distill.output={tmp_path / 'out'}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = shard_rows(tmp_path / "out")
        assert len(rows) == 3 and all(r["messages"][-1]["content"].strip() for r in rows)
        meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
        assert meta["server"]["tokenizer_check"].startswith("tokenize") and meta["server"]["engine"]
        # the weights compared: vLLM's fp32 log-probabilities of the probe against the target's here
        assert meta["server"]["check"] == "logprobs" and meta["server"]["logprobs"]["prompt_as"] == "token ids"
        assert meta["server"]["logprobs"]["max_abs_diff"] < 1e-3, meta["server"]["logprobs"]
        # the same prompts answered by the target loaded here: the server's answers are its own
        hf = subprocess.run(
            [
                sys.executable,
                str(ROOT / "distill.py"),
                f"distill.prompts={prompts}",
                "distill.max_new_tokens=32",
                "distill.num_prompts=null",
                f"distill.output={tmp_path / 'hf'}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
        )
        assert hf.returncode == 0, hf.stderr[-2000:]
        assert [r["messages"] for r in rows] == [r["messages"] for r in shard_rows(tmp_path / "hf")]
    finally:
        subprocess.run([*serve, "stop"], capture_output=True, text=True, env=env)
