"""Is the served model the target? Its weights, compared through next-token log-probabilities.

A tokenizer and chat template are shared by a whole family (Qwen2.5-0.5B and -7B, Llama-3.1-8B and
-70B), so comparing them cannot tell a family's members apart. What only the same weights produce is
the distribution over the next token: `distill.server.identity=logprobs` loads the target here
(specheads.target.load_target, the run's own ModelConfig, on the CPU), runs one forward over a short
chat-templated probe, asks the server for the same position's top log-probabilities (OpenAI
completions API, `logprobs`, max_tokens=1, temperature 0: vLLM, SGLang and llama.cpp's server return
them) and compares. `auto` does so when the target fits here (see `loadable`), else checks the
tokenizer only and says so on stderr; `tokenizer` is the tokenizer and chat-template check alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..chat_template import apply_chat
from ..config.model import ModelConfig
from ..errors import SpecHeadsError

IDENTITY_CHECKS = ("auto", "logprobs", "tokenizer")

# A few tokens, chat-templated with the generation prompt: the answer's first token is open (many
# animals, "Sure", "A", ...), so the top log-probabilities spread over several tokens and carry the
# weights' fingerprint; a position where one token has all the mass would compare ~0 with ~0.
LOGPROB_PROBE = [{"role": "user", "content": "Name one animal."}]
TOP_LOGPROBS = 5  # OpenAI's own limit for the completions API; vLLM allows 20 by default

# In nats, on each of the top log-probabilities (sorted, so a reordering of near-equal tokens does
# not count twice). Here the target runs in fp32; a server runs in bf16 (8-bit mantissa: every
# rounding is ~0.4%), fp16, or a quantized format (GGUF Q4/Q8, AWQ, fp8). Over a probe of a few
# dozen tokens that moves a 7B-70B model's final logits by ~0.05-0.2, and a log-probability by up
# to twice its logits' error (the logit and the log-sum-exp both move); 4-bit weights add as much
# again. 0.5 leaves that room, while other weights (another size of the family, another seed) move
# the top log-probabilities by whole nats and usually change the top token, which must agree anyway.
LOGPROB_TOLERANCE = 0.5

# weight files, by preference (a repository often carries both safetensors and .bin: transformers
# loads the safetensors, so only those count)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def probe_ids(tokenizer) -> list[int]:
    ids = apply_chat(tokenizer, LOGPROB_PROBE, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def probe_text(tokenizer) -> str:
    return apply_chat(tokenizer, LOGPROB_PROBE, add_generation_prompt=True, tokenize=False)


# -- can the target be loaded here? -----------------------------------------------------------------


def machine_ram() -> int | None:
    """This machine's memory in bytes (a container's cgroup limit where that is lower)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and (ram is None or int(text) < ram):
            ram = int(text)
    return ram


def _pick_weight_files(sizes: dict[str, int], gguf_file: str | None) -> int | None:
    """Total size of the files transformers loads from a repository listing {name: bytes}."""
    if gguf_file is not None:
        return sizes.get(gguf_file)
    for suffix in WEIGHT_SUFFIXES:
        files = {n: s for n, s in sizes.items() if n.endswith(suffix) and "/" not in n.strip("./")}
        # Mistral's repositories carry consolidated.safetensors beside the sharded model-*.safetensors
        if len(files) > 1:
            files = {n: s for n, s in files.items() if not Path(n).name.startswith("consolidated")} or files
        if files:
            return sum(files.values())
    return None


def weight_bytes(cfg: ModelConfig) -> tuple[int | None, str]:
    """The target's weight files' total size, from their sizes (nothing is loaded), and where it was
    read; None and why where it cannot be read (a Hub id that is neither reachable nor cached)."""
    path = cfg.path
    local = Path(path).expanduser()
    if local.is_file():
        return local.stat().st_size, f"{local.name}"
    if local.is_dir():
        sizes = {p.name: p.stat().st_size for p in local.iterdir() if p.is_file()}
        total = _pick_weight_files(sizes, cfg.gguf_file)
        return total, (f"the weight files in {local.name}" if total is not None else f"no weight file in {local}")
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(path, revision=cfg.revision, files_metadata=True)
        sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    except Exception as err:  # offline, gated, unknown: try the local cache next
        sizes, why = {}, f"{type(err).__name__}"
        try:
            from huggingface_hub import snapshot_download

            cached = Path(snapshot_download(path, revision=cfg.revision, local_files_only=True))
            sizes = {p.name: p.stat().st_size for p in cached.iterdir() if p.is_file()}
        except Exception:
            return None, f"the Hub does not list {path}'s files ({why}) and they are not cached here"
    total = _pick_weight_files(sizes, cfg.gguf_file)
    return total, (f"{path}'s weight files on the Hub" if total is not None else f"no weight file listed for {path}")


def loadable(cfg: ModelConfig) -> tuple[bool, str]:
    """Whether `auto` loads the target here for the comparison: the embedded target always, a local
    or Hub target when its weight files total less than a quarter of this machine's memory (loaded in
    fp32 on the CPU, a bf16 checkpoint takes twice its size); and why not."""
    from ..target import EMBEDDED_PREFIX, TINY_PREFIX

    if cfg.path.startswith((EMBEDDED_PREFIX, TINY_PREFIX)):
        return True, "the embedded target"
    size, where = weight_bytes(cfg)
    if size is None:
        return False, f"its size is unknown: {where}"
    ram = machine_ram()
    if ram is None:
        return False, "this machine's memory is unknown"
    gib = 2**30
    if size * 4 >= ram:
        return False, (
            f"its weights ({size / gib:.1f} GiB, {where}) are not under a quarter of this machine's "
            f"{ram / gib:.1f} GiB of memory"
        )
    return True, f"its weights ({size / gib:.1f} GiB) are under a quarter of this machine's {ram / gib:.1f} GiB"


def weights_for_check(target, identity: str):
    """(a target with weights to compare with, None) or (None, why not) under `auto`; under
    `logprobs` a target that cannot be had is an error. A target without weights here (the server
    backend reads only the tokenizer) carries its ModelConfig as `source`."""
    if getattr(target, "model", None) is not None:
        return target, None
    cfg = getattr(target, "source", None)
    if cfg is None:
        if identity == "logprobs":
            raise SpecHeadsError(
                "distill.server.identity=logprobs needs the target's weights here and there are none: "
                "set distill.server.identity=tokenizer"
            )
        return None, "the target's weights are not available here"
    if identity == "auto":
        ok, why = loadable(cfg)
        if not ok:
            return None, f"the target is too large to load here for it: {why}"
    from ..target import load_target

    return load_target(cfg, torch.device("cpu")), None


# -- the comparison ---------------------------------------------------------------------------------


def local_logprobs(target, ids: list[int]) -> torch.Tensor:
    """The target's next-token log-softmax after `ids` (fp32, on the CPU)."""
    model = target.model
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def parse_top_logprobs(choice: dict) -> list[tuple[int | str, float]] | None:
    """[(token, logprob)] of the first generated position, best first: the token as an id where the
    server gives one (vLLM's `token_id:N` with return_tokens_as_token_ids, llama.cpp's `id`), else as
    its text; None where the answer carries no log-probabilities."""
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    if not lp:
        return None
    entries: list[tuple[int | str, float]] = []
    if isinstance(lp.get("top_logprobs"), list) and lp["top_logprobs"]:  # OpenAI completions (vLLM, SGLang)
        top = lp["top_logprobs"][0] or {}
        for key, value in top.items():
            entries.append((_token_key(key), float(value)))
    elif isinstance(lp.get("content"), list) and lp["content"]:  # llama.cpp, OpenAI chat style
        first = lp["content"][0] or {}
        for item in first.get("top_logprobs") or []:
            key = item["id"] if isinstance(item.get("id"), int) else _token_key(item.get("token", ""))
            entries.append((key, float(item["logprob"])))
    if not entries:
        return None
    return sorted(entries, key=lambda e: -e[1])


def _token_key(key: str) -> int | str:
    if isinstance(key, str) and key.startswith("token_id:") and key[len("token_id:") :].isdigit():
        return int(key[len("token_id:") :])
    return key


def compare(local: torch.Tensor, served: list[tuple[int | str, float]], tokenizer) -> dict:
    """How the server's top log-probabilities compare with the target's: max_abs_diff over the
    sorted top values, and whether the top tokens agree (where the target's own best tokens are
    within the tolerance of each other, the server may pick any of them)."""
    k = min(len(served), TOP_LOGPROBS)
    top = torch.topk(local, k)
    local_values = [float(v) for v in top.values]
    served_values = [v for _, v in served[:k]]
    diff = max(abs(a - b) for a, b in zip(local_values, served_values))
    best = float(top.values[0])
    tied = [int(i) for i, v in zip(top.indices, top.values) if best - float(v) <= LOGPROB_TOLERANCE]
    key = served[0][0]
    if isinstance(key, int):
        agree = key in tied
    else:
        agree = any(key in (tokenizer.decode([i]), tokenizer.convert_ids_to_tokens(i)) for i in tied)
    return {
        "agree": agree,
        "max_abs_diff": diff,
        "served_top": key if isinstance(key, str) else tokenizer.decode([key]),
        "target_top": tokenizer.decode([int(top.indices[0])]),
        "compared": k,
    }
