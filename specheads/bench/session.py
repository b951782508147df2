"""What infer.py needs around the generation loop: find and load the head and its target, pick the
tree, encode prompts, and print a streamed answer with the drafted-and-accepted tokens marked."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

import torch
from omegaconf import OmegaConf

from ..config.train import ModelConfig
from ..decode.drafters import DynamicTreeSpec, TreePolicy, make_drafter
from ..errors import SpecHeadsError
from ..decode.generate import SamplingConfig
from ..config.infer import InferJobConfig, TreeConfig
from ..target import FrozenTarget, load_target, resolve_device
from ..decode.tree import StaticTree, chain_paths, static_tree

# Medusa's default when the head stores no tree: 16 nodes over 3 depths (conf/tree/medusa.yaml).
MEDUSA_PATHS = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
                [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 2], [2, 0, 0]]


@dataclass
class Session:
    target: FrozenTarget
    head: Any  # DraftHead or None (baseline-only benchmark)
    head_dir: Optional[Path]
    head_config: dict


def model_config_for_head(head_config: dict, conf_dir: Path) -> ModelConfig:
    """The target a head was trained for: its training record, a conf/model option with the
    target's name, or else the name itself as a Hub id / path."""
    base = OmegaConf.structured(ModelConfig)
    recorded = (head_config.get("training") or {}).get("model")
    if isinstance(recorded, dict):
        known = {k: v for k, v in recorded.items() if k in ModelConfig.__dataclass_fields__}
        return OmegaConf.to_object(OmegaConf.merge(base, known))
    target = head_config.get("target") or {}
    name = target.get("name")
    if not name:
        raise SpecHeadsError("the head's config.json names no target; give model=NAME")
    for path in sorted((conf_dir / "model").glob("*.yaml")):
        data = OmegaConf.load(path)
        if data.get("name") == name or path.stem == name:
            data.pop("defaults", None)
            return OmegaConf.to_object(OmegaConf.merge(base, data))
    return ModelConfig(name=name, path=name, revision=target.get("revision"))


def load_session(settings: InferJobConfig, conf_dir: Path) -> Session:
    from ..export import is_exported_dir, open_head, resolve_head_path
    from ..heads import read_head_config

    head_dir = resolve_head_path(settings.head_path) if settings.head_path else None
    if head_dir is not None and not head_dir.is_dir():
        raise SpecHeadsError(f"head={settings.head_path} is not a directory (config.json + model.safetensors)")
    exported = head_dir is not None and is_exported_dir(head_dir)
    head_config = read_head_config(head_dir) if head_dir is not None and not exported else {}
    if settings.model is not None:
        model_cfg = settings.model
    elif exported:
        raise SpecHeadsError(f"{head_dir} is an engine-format head that names no specheads target: give model=NAME")
    else:
        model_cfg = model_config_for_head(head_config, conf_dir)
    target = load_target(model_cfg, resolve_device(settings.device))
    head = open_head(head_dir, target) if head_dir else None
    return Session(target, head, head_dir, head_config)


def tree_policy_for(head, tree: TreeConfig) -> TreePolicy:
    """The tree to draft: tree.kind, or for `default` the head's stored tree, else a family default."""
    kind = tree.kind
    if kind == "static":
        if not tree.paths:
            raise SpecHeadsError("tree=static needs tree.paths, e.g. 'tree.paths=[[0],[1],[0,0]]'")
        policy: TreePolicy = static_tree(tree.paths)
    elif kind == "chain":
        policy = static_tree(chain_paths(tree.depth))
    elif kind == "dynamic":
        policy = DynamicTreeSpec(tree.depth, tree.top_k, tree.total_tokens)
    elif kind == "default":
        if head.default_tree:
            policy = static_tree(head.default_tree)
        elif head.family == "medusa":
            depth = head.spec.num_heads
            paths = {tuple(p) for p in MEDUSA_PATHS if len(p) <= depth} | {tuple(p) for p in chain_paths(depth)}
            policy = static_tree(sorted(paths))
        else:
            policy = DynamicTreeSpec(tree.depth, tree.top_k, tree.total_tokens)
    else:
        raise SpecHeadsError(f"tree.kind={kind} is resolved by calibration, not here")
    if head.family == "medusa":
        depth = policy.layout.max_depth if isinstance(policy, StaticTree) else policy.depth
        if depth > head.spec.num_heads:
            raise SpecHeadsError(f"the tree is {depth} deep but the Medusa head has {head.spec.num_heads} heads")
    return policy


def describe_policy(policy: TreePolicy) -> str:
    if isinstance(policy, StaticTree):
        return f"static tree ({policy.size - 1} nodes, depth {policy.layout.max_depth})"
    return f"dynamic tree (depth {policy.depth}, top_k {policy.top_k}, {policy.total_tokens} nodes)"


def eos_token_ids(target: FrozenTarget) -> list[int]:
    ids = set()
    gen = getattr(target.model, "generation_config", None)
    value = getattr(gen, "eos_token_id", None)
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if v is not None:
            ids.add(int(v))
    tok = target.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(ids)


def sampling_config(settings: InferJobConfig, max_new_tokens: int, eos: Sequence[int]) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                          top_k=settings.top_k, acceptance=settings.acceptance,
                          typical_epsilon=settings.typical_epsilon, typical_alpha=settings.typical_alpha,
                          eos_token_ids=list(eos))


def encode_prompt(tokenizer, text: str, system: Optional[str] = None, chat: bool = True) -> list[int]:
    """Token ids of one user turn (chat template with the generation prompt), or the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]


class TokenPrinter:
    """Streams decoded text; tokens drafted by the head and accepted by the target are marked.

    Text is re-decoded from the start for every token so that byte-level tokens that split a
    character come out right (a piece ending in an incomplete character waits for the next).
    """

    MARKS = {"ansi": ("\x1b[1;32m", "\x1b[0m"), "brackets": ("«", "»"), "none": ("", "")}

    def __init__(self, tokenizer, style: str = "auto", out: TextIO = sys.stdout):
        if style == "auto":
            style = "ansi" if out.isatty() else "brackets"
        self.open, self.close = self.MARKS[style]
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.printed = ""
        self.marking = False

    def legend(self) -> str:
        if not self.open:
            return ""
        return f"{self.open}marked{self.close} = drafted by the head and accepted by the target"

    def __call__(self, ids: list[int], drafted: list[bool]) -> None:
        for token, flag in zip(ids, drafted):
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd") or not text.startswith(self.printed):
                continue
            piece, self.printed = text[len(self.printed):], text
            if not piece:
                continue
            if flag and not self.marking:
                self.out.write(self.open)
            elif not flag and self.marking:
                self.out.write(self.close)
            self.marking = flag
            self.out.write(piece)
        self.out.flush()

    def finish(self) -> None:
        if self.marking:
            self.out.write(self.close)
            self.marking = False
        self.out.write("\n")
        self.out.flush()


def run_demo(settings: InferJobConfig, session: Session, out: TextIO = sys.stdout) -> dict:
    """Answer one prompt with speculative decoding; print it marked, then a stats line."""
    from .runner import hf_generate
    from ..decode.generate import speculative_generate

    target, head = session.target, session.head
    ids = encode_prompt(target.tokenizer, settings.prompt, settings.system, settings.chat)
    prompt = torch.tensor([ids], device=target.device)
    eos = eos_token_ids(target)
    cfg = sampling_config(settings, settings.max_new_tokens, eos)
    policy = tree_policy_for(head, settings.tree)
    drafter = make_drafter(head, policy)
    gen = torch.Generator(device=target.device).manual_seed(settings.seed)
    # warm-up (first calls pay for lazy initialisation), not timed
    warm = sampling_config(settings, 4, eos)
    speculative_generate(target, drafter, prompt, warm, generator=gen)
    if settings.compare:
        hf_generate(target, prompt, warm)
    printer = TokenPrinter(target.tokenizer, settings.mark, out)
    res = speculative_generate(target, drafter, prompt, cfg, on_step=printer, generator=gen)
    printer.finish()
    stats = {"new_tokens": res.new_tokens, "target_forwards": res.target_forwards, "tau": res.tau,
             "tokens_per_s": res.new_tokens / res.wall_s if res.wall_s else 0.0}
    line = (f"[{head.family} head, {describe_policy(policy)}] tau {res.tau:.2f} | "
            f"{stats['tokens_per_s']:.1f} tokens/s | {res.new_tokens} tokens, {res.target_forwards} target forwards")
    if settings.compare:
        torch.manual_seed(settings.seed)
        base = hf_generate(target, prompt, cfg)
        base_tps = len(base["output_ids"]) / base["wall_s"] if base["wall_s"] else 0.0
        stats["baseline_tokens_per_s"] = base_tps
        stats["speedup"] = stats["tokens_per_s"] / base_tps if base_tps else 0.0
        line += f" | speedup {stats['speedup']:.2f}x vs plain decoding ({base_tps:.1f} tokens/s)"
        if settings.temperature <= 0:
            same = base["output_ids"] == res.output_ids
            stats["identical_to_baseline"] = same
            line += f" | identical to plain greedy: {'yes' if same else 'NO'}"
    legend = printer.legend()
    if legend:
        out.write(legend + "\n")
    out.write(line + "\n")
    out.flush()
    return stats
