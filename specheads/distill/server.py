"""Answers from an OpenAI-compatible chat server (vLLM, SGLang, TGI, llama.cpp's server).

A large target is served where it fits (`vllm serve MODEL --tensor-parallel-size N`) and many
requests stay in flight, which is how regeneration keeps a serving engine's batches full. The
client is the `openai` package. Before the first answer the server must show that it serves the
target `model=` names: a served model's name can be anything, so the check compares what can be
compared: the chat-templated encoding of a probe conversation through the server's /tokenize
endpoint (vLLM, SGLang) or, where there is none (or it does not read messages: llama.cpp's), the
prompt's token count the server reports. That tells a tokenizer apart, not a model of the same
family (Qwen2.5-0.5B for -7B): with `distill.server.identity` logprobs (or auto, where the target
fits here) the server's next-token log-probabilities on a probe are compared with the target's own
loaded here (specheads.distill.identity).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..chat_template import apply_chat, template_kwargs
from ..config.distill import ServerConfig
from ..errors import SpecHeadsError
from . import identity as ident

# Mixed scripts, digits, code and whitespace: tokenizers that differ anywhere tend to differ here.
PROBE = [
    {"role": "system", "content": "You are a careful assistant."},
    {
        "role": "user",
        "content": "Tokenizer probe: naïve café, 東京 1234567.89 — def f(x):\n    return x**2  # ok?\n\tÆØÅ 🙂",
    },
]

# HTTP statuses that refuse one request for what it asks (vLLM and SGLang answer 400 to a prompt and
# max_tokens over the served context), not the server failing: that conversation is skipped
REFUSED = (400, 413, 422)


@dataclass
class ServedModel:
    """What the identity check established about the server."""

    url: str
    model: str
    check: str  # "logprobs" (the weights were compared) or "tokenizer" (the tokenizer only)
    tokenizer_check: str  # how the tokenizer and chat template were compared
    engine: str | None = None  # the server's /version, where it has one
    logprobs: dict | None = None  # the weights' comparison, where it ran

    def describe_check(self) -> str:
        if self.logprobs is None:
            return f"tokenizer ({self.tokenizer_check})"
        lp = self.logprobs
        return (
            f"logprobs (top {lp['compared']} next-token log-probabilities within {lp['max_abs_diff']:.2g} "
            f"<= {lp['tolerance']} of the target's) and {self.tokenizer_check}"
        )


def _client(cfg: ServerConfig):
    try:
        import openai
    except ImportError:
        raise SpecHeadsError(
            "distill.backend=server needs the openai package: pip install 'specheads[server]'"
        ) from None
    # httpx logs every request at INFO, and the entry points log INFO to stdout: thousands of lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    key = cfg.api_key or os.environ.get("OPENAI_API_KEY") or "none"
    # Retries are the client's own (connection errors, 408/409/429/5xx, with backoff).
    return openai.OpenAI(base_url=cfg.url, api_key=key, timeout=cfg.timeout, max_retries=cfg.retries)


def _server_root(url: str) -> str:
    """vLLM and SGLang put /tokenize and /version beside /v1, not under it."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _why(err: Exception) -> str:
    import openai

    if isinstance(err, openai.APIStatusError):
        text = str(getattr(err, "message", "") or err).strip()
        return f"HTTP {err.status_code}: {text.splitlines()[0][:200] if text else ''}"
    if isinstance(err, openai.APITimeoutError):
        return "timed out"
    if isinstance(err, openai.APIConnectionError):
        cause = err.__cause__ or err
        return f"cannot connect ({type(cause).__name__}: {str(cause).splitlines()[0][:160] if str(cause) else ''})"
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


class ServerBackend:
    """`answer(conversations, seed, desc)` -> [(text, finished, tokens)] from the served target."""

    name = "server"

    def __init__(self, cfg: ServerConfig, tokenizer, max_new_tokens: int, temperature: float, top_p: float):
        if not cfg.url:
            raise SpecHeadsError("distill.backend=server needs distill.server.url=http://HOST:PORT/v1")
        if not cfg.url.startswith(("http://", "https://")):
            raise SpecHeadsError(f"distill.server.url must be an http(s) URL, got {cfg.url!r}")
        if cfg.concurrency < 1:
            raise SpecHeadsError("distill.server.concurrency must be >= 1")
        if cfg.identity not in ident.IDENTITY_CHECKS:
            raise SpecHeadsError(
                f"unknown distill.server.identity={cfg.identity!r}; use one of {list(ident.IDENTITY_CHECKS)}"
            )
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.client = _client(cfg)
        self.served: ServedModel | None = None
        self.completion_tokens = 0
        self._lock = threading.Lock()

    # -- identity -------------------------------------------------------------------------------

    def connect(self, target_name: str, weights=None) -> ServedModel:
        """Pick the served model and check that it is the target; one line and no request otherwise.
        With `weights` (a target loaded here) the served model's log-probabilities are compared with
        its own too; without, the tokenizer and chat template only."""
        import openai

        try:
            served = [m.id for m in self.client.models.list()]
        except openai.OpenAIError as err:
            raise SpecHeadsError(f"distill.server.url={self.cfg.url}: {_why(err)}") from None
        if self.cfg.model is not None:
            if self.cfg.model not in served:
                raise SpecHeadsError(
                    f"the server at {self.cfg.url} does not serve {self.cfg.model!r} (it serves {served})"
                )
            model = self.cfg.model
        elif len(served) == 1:
            model = served[0]
        else:
            raise SpecHeadsError(
                f"the server at {self.cfg.url} serves {len(served)} models {served}: "
                "pick one with distill.server.model="
            )
        tokenizer_check = self._check_identity(model, target_name)
        logprobs = self._check_logprobs(model, target_name, weights) if weights is not None else None
        check = "tokenizer" if logprobs is None else "logprobs"
        self.served = ServedModel(self.cfg.url, model, check, tokenizer_check, self._engine_version(), logprobs)
        return self.served

    def _local_probe_ids(self) -> list[int]:
        ids = apply_chat(self.tokenizer, PROBE, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _check_identity(self, model: str, target_name: str) -> str:
        import httpx

        local = self._local_probe_ids()
        mismatch = f"the server at {self.cfg.url} serves {model!r}, which is not the target model={target_name}"
        try:
            r = httpx.post(
                f"{_server_root(self.cfg.url)}/tokenize",
                json={"model": model, "messages": PROBE, "add_generation_prompt": True, **self.template_fields()},
                timeout=self.cfg.timeout,
            )
        except httpx.HTTPError as err:
            raise SpecHeadsError(f"distill.server.url={self.cfg.url}: cannot connect ({err})") from None
        # llama.cpp's /tokenize reads "content" only and answers this body with no token: no answer
        tokens = r.json().get("tokens") if r.status_code == 200 else None
        if isinstance(tokens, list) and tokens:
            remote = [int(t) for t in tokens]
            if remote != local:
                at = next((i for i, (a, b) in enumerate(zip(remote, local)) if a != b), min(len(remote), len(local)))
                raise SpecHeadsError(
                    f"{mismatch}: its tokenizer and chat template encode a probe differently "
                    f"({len(remote)} vs {len(local)} tokens, first difference at token {at})"
                )
            return f"tokenize: the probe's {len(local)} chat-templated tokens are identical"
        # No tokenize endpoint: the prompt's token count, which every OpenAI-compatible server reports.
        import openai

        try:
            reply = self.client.chat.completions.create(
                model=model, messages=PROBE, max_tokens=1, temperature=0.0, extra_body=self.template_fields() or None
            )
        except openai.OpenAIError as err:
            raise SpecHeadsError(f"distill.server.url={self.cfg.url}: {_why(err)}") from None
        counted = getattr(reply.usage, "prompt_tokens", None)
        if counted != len(local):
            raise SpecHeadsError(
                f"{mismatch}: it counts {counted} prompt tokens in a probe where the target has {len(local)}"
            )
        return f"prompt_tokens: the probe counts {counted} tokens on both sides (the server has no /tokenize)"

    def _check_logprobs(self, model: str, target_name: str, weights) -> dict:
        """The served model's top log-probabilities for the token after a short chat-templated probe,
        against the target's own forward here: the top token must agree and the values be within
        identity.LOGPROB_TOLERANCE, else one line naming both."""
        import openai

        ids = ident.probe_ids(self.tokenizer)
        fix = "set distill.server.identity=tokenizer to check its tokenizer and chat template only"
        request = dict(model=model, max_tokens=1, logprobs=ident.TOP_LOGPROBS, **self.openai_sampling())
        request["temperature"] = 0.0
        # return_tokens_as_token_ids: vLLM names the tokens "token_id:N" (a text can be several
        # tokens'); n_probs: llama.cpp's name for the count. Servers ignore what they do not know.
        extra = {**self.engine_sampling(), "return_tokens_as_token_ids": True, "n_probs": ident.TOP_LOGPROBS}
        prompt_as = "token ids"
        try:
            reply = self.client.completions.create(prompt=ids, extra_body=extra, **request)
        except openai.APIStatusError as err:
            if err.status_code not in REFUSED:
                raise SpecHeadsError(
                    f"the server at {self.cfg.url} answered no log-probabilities for the identity probe "
                    f"({_why(err)}): {fix}"
                ) from None
            reply, prompt_as = None, "text"  # no token-id prompts here: the text, tokenized there
        except openai.OpenAIError as err:
            raise SpecHeadsError(f"distill.server.url={self.cfg.url}: {_why(err)}") from None
        if reply is None:
            try:
                reply = self.client.completions.create(
                    prompt=ident.probe_text(self.tokenizer), extra_body=extra, **request
                )
            except openai.OpenAIError as err:
                raise SpecHeadsError(
                    f"the server at {self.cfg.url} answered no log-probabilities for the identity probe "
                    f"({_why(err)}): {fix}"
                ) from None
            counted = getattr(reply.usage, "prompt_tokens", None)
            if counted is not None and counted != len(ids):
                raise SpecHeadsError(
                    f"the server at {self.cfg.url} takes no token ids and tokenizes the identity probe's text "
                    f"into {counted} tokens where the target has {len(ids)}: its log-probabilities cannot be "
                    f"compared; {fix}"
                )
        choice = reply.choices[0].model_dump() if reply.choices else {}
        served = ident.parse_top_logprobs(choice)
        if served is None:
            raise SpecHeadsError(f"the server at {self.cfg.url} returned no log-probabilities for {model!r}: {fix}")
        result = ident.compare(ident.local_logprobs(weights, ids), served, self.tokenizer)
        tol = ident.LOGPROB_TOLERANCE
        if not result["agree"] or result["max_abs_diff"] > tol:
            how = (
                f"its next token is {result['served_top']!r} where the target's is {result['target_top']!r}, and "
                if not result["agree"]
                else ""
            ) + (
                f"its top {result['compared']} log-probabilities differ from the target's by up to "
                f"{result['max_abs_diff']:.3f} (tolerance {tol})"
            )
            raise SpecHeadsError(
                f"the server at {self.cfg.url} serves {model!r}, which is not the target model={target_name}: "
                f"on an identity probe {how}, so its weights are others"
            )
        return {
            "max_abs_diff": result["max_abs_diff"],
            "tolerance": tol,
            "compared": result["compared"],
            "probe_tokens": len(ids),
            "prompt_as": prompt_as,
        }

    def _engine_version(self) -> str | None:
        import httpx

        try:
            r = httpx.get(f"{_server_root(self.cfg.url)}/version", timeout=10)
            return str(r.json().get("version")) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    # -- answering ------------------------------------------------------------------------------

    def openai_sampling(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "presence_penalty": 0.0, "frequency_penalty": 0.0}

    def engine_sampling(self) -> dict:
        """The engines' own fields (vLLM, SGLang, llama.cpp): -1 / 0 / 1 switch each off."""
        return {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}

    def template_fields(self) -> dict:
        """The target's chat-template variables (model.thinking) as vLLM and SGLang take them in a
        chat or tokenize request, so that the server renders as the target does here; {} for the
        template's defaults (a server that knows no such field is not sent one)."""
        kwargs = template_kwargs(self.tokenizer)
        return {"chat_template_kwargs": kwargs} if kwargs else {}

    def sampling(self) -> dict:
        """Every sampling field a request sets. vLLM fills the ones it leaves out from the served
        model's generation_config.json (`--generation-config auto`: Qwen2.5-Instruct's repetition
        penalty 1.05, top_k 20, ...), so none is left out: the answers are the target's own."""
        return {**self.openai_sampling(), **self.engine_sampling()}

    def _one(self, messages: list[dict], seed: int) -> tuple[str, bool, int] | None:
        """One answer, or None where the server refuses this request itself (REFUSED: a prompt over its
        context, say): that conversation is skipped, not the run. Any other failure ends the run."""
        import openai

        try:
            reply = self.client.chat.completions.create(
                model=self.served.model,
                messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                max_tokens=self.max_new_tokens,
                seed=seed,
                **self.openai_sampling(),
                extra_body={**self.engine_sampling(), **self.template_fields()},
            )
        except openai.OpenAIError as err:
            if isinstance(err, openai.APIStatusError) and err.status_code in REFUSED:
                return None
            raise SpecHeadsError(f"the server at {self.cfg.url} failed a request: {_why(err)}") from None
        choice = reply.choices[0]
        tokens = int(getattr(reply.usage, "completion_tokens", 0) or 0)
        with self._lock:
            self.completion_tokens += tokens
        # "length": cut off by max_new_tokens; anything else ("stop") ended the turn.
        return choice.message.content or "", choice.finish_reason != "length", tokens

    def answer(
        self, conversations: list[list[dict]], seed: int, desc: str | None = None
    ) -> list[tuple[str, bool, int] | None]:
        if self.served is None:
            raise RuntimeError("ServerBackend.connect() must run before answer()")
        results: list[tuple[str, bool, int] | None] = [None] * len(conversations)
        bar = tqdm(total=len(conversations), desc=desc, unit="answer", leave=False, disable=desc is None)

        def run(i: int) -> None:
            results[i] = self._one(conversations[i], seed + i)
            bar.update(1)

        # A failed request ends the batch: requests not yet sent are cancelled, those in flight
        # finish, and the caller writes nothing of the shard.
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency) as pool:
            futures = [pool.submit(run, i) for i in range(len(conversations))]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in done if f.exception() is not None), None)
            if failed is not None:
                for f in futures:
                    f.cancel()
                bar.close()
                raise failed.exception()
        bar.close()
        return results
