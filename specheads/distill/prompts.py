"""User prompts for distillation: read from a data set, or written by the target (Magpie).

Magpie: an aligned chat model given only the chat template's user-turn prefix writes a plausible
user request. A small model's bare requests are narrow, so each one is conditioned on a topic and
a task type placed in one of several system prompts, and sampled at temperature ~1.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from ..chat_template import apply_chat
from ..config.distill import MagpieConfig
from ..data.chat import special_token_ids
from ..data.decontaminate import PROMPT_KEYS, NgramIndex, words
from ..data.formats import iter_rows, row_to_conversation, user_turns
from ..data.sharegpt import SOURCE_NAME as SHAREGPT_SOURCE
from ..data.sharegpt import read_sharegpt
from ..errors import SpecHeadsError
from .generation import generate

# Written for this project (not taken from any evaluation set): what kind of request to write.
TASK_TYPES = {
    "writing": "asks for a piece of writing: an email, a blog post, a poem, a speech or a short story",
    "roleplay": "asks the assistant to play a character or act out a scenario",
    "reasoning": "asks a puzzle or a question that needs careful step-by-step reasoning",
    "math": "asks a math problem (arithmetic, algebra, geometry, probability or statistics)",
    "coding": "asks for help writing, explaining or fixing a program or a function",
    "extraction": "gives a short text and asks to extract, list or summarize information from it",
    "stem": "asks a question about science, technology, engineering or medicine",
    "humanities": "asks about history, philosophy, literature, art, economics or society",
    "advice": "asks for practical advice or a plan",
    "explanation": "asks for a simple explanation of a concept",
    "brainstorming": "asks for a list of ideas",
    "editing": "gives a sentence or paragraph and asks to rewrite, shorten or correct it",
    "comparison": "asks to compare two things and explain the differences",
    "classification": "asks to sort, rank or classify a few items",
    "conversation": "chats casually and asks for an opinion",
}

TOPICS = [
    "cooking",
    "baking bread",
    "travel in Japan",
    "a trip to the mountains",
    "personal finance",
    "saving for retirement",
    "job interviews",
    "starting a small business",
    "marketing",
    "climate change",
    "renewable energy",
    "recycling",
    "gardening",
    "house plants",
    "pets",
    "dog training",
    "birds",
    "ocean life",
    "dinosaurs",
    "the solar system",
    "black holes",
    "space exploration",
    "the human body",
    "nutrition",
    "running",
    "yoga",
    "sleep",
    "mental health",
    "friendship",
    "parenting",
    "wedding planning",
    "moving to a new city",
    "public speaking",
    "learning a language",
    "studying for exams",
    "college applications",
    "ancient Rome",
    "ancient Egypt",
    "the Middle Ages",
    "the industrial revolution",
    "world war history",
    "democracy and elections",
    "economics and inflation",
    "supply and demand",
    "philosophy of mind",
    "ethics",
    "poetry",
    "novels and fiction",
    "movies",
    "music theory",
    "playing guitar",
    "painting",
    "photography",
    "architecture",
    "fashion",
    "video games",
    "board games",
    "chess",
    "soccer",
    "basketball",
    "the Olympics",
    "smartphones",
    "the internet",
    "cybersecurity",
    "artificial intelligence",
    "databases",
    "web development",
    "Python programming",
    "JavaScript",
    "sorting algorithms",
    "data structures",
    "spreadsheets",
    "statistics",
    "probability",
    "geometry",
    "algebra",
    "fractions and percentages",
    "chemistry",
    "physics of motion",
    "electricity",
    "genetics",
    "evolution",
    "vaccines",
    "weather",
    "volcanoes and earthquakes",
    "rivers and lakes",
    "forests",
    "cars and engines",
    "bicycles",
    "trains",
    "airplanes",
    "cities and urban planning",
    "law and contracts",
    "taxes",
    "customer service",
    "team management",
    "time management",
    "a birthday party",
    "a science fair project",
    "a fantasy kingdom",
    "a detective mystery",
    "a haunted house",
    "pirates",
    "robots",
    "a small village",
    "a coffee shop",
    "a restaurant review",
    "a product launch",
    "a hiking accident",
    "a lost wallet",
]

SYSTEM_TEMPLATES = [
    "You are a helpful AI assistant. The user {task}. The topic is {topic}.",
    "The user is about to send a request about {topic}. The user {task}.",
    "You are an expert on {topic}. A user {task}.",
    "Conversation topic: {topic}. The user {task}.",
    "You are a friendly assistant who helps people with {topic}. In this conversation the user {task}.",
    "You answer questions from curious people. Today's user is interested in {topic} and {task}.",
    "You are a knowledgeable assistant. The next message is from a user who {task}, about {topic}.",
    "You are a chatbot. The user {task}. Subject: {topic}.",
]

FOLLOW_UP_SYSTEMS = [
    "The user continues the conversation with a follow-up request about the previous answer.",
    "The user asks the assistant to change, extend or shorten its previous answer.",
    "The user asks a related follow-up question.",
    "The user asks for more details or an example about the previous answer.",
]

SENTINEL = "\u2063SPECHEADS\u2063"  # invisible separators: never part of a real template


def user_turn_prefix(tokenizer, history: list[dict]) -> str:
    """The rendered text up to where the next user message's content would start."""
    text = apply_chat(tokenizer, history + [{"role": "user", "content": SENTINEL}], tokenize=False)
    if SENTINEL not in text:
        raise SpecHeadsError("the chat template drops user content; cannot write Magpie prompts")
    return text[: text.index(SENTINEL)]


def end_of_turn_ids(tokenizer, model=None) -> set[int]:
    """Token ids that end a turn: eos, the generation config's eos, and the token the template
    puts right after a message's content (e.g. <|im_end|>)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    text = apply_chat(tokenizer, [{"role": "user", "content": SENTINEL}], tokenize=False)
    after = text[text.index(SENTINEL) + len(SENTINEL) :]
    after_ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if after_ids and after_ids[0] in special_token_ids(tokenizer):
        ids.add(int(after_ids[0]))
    if not ids:
        raise SpecHeadsError("the tokenizer has no end-of-turn token (eos); cannot generate")
    return ids


def normalise(text: str) -> str:
    return " ".join(words(text))


def conditioning_systems(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """n (task type, system prompt) pairs drawn over topics x task types x templates."""
    tasks = list(TASK_TYPES)
    out = []
    for _ in range(n):
        task = rng.choice(tasks)
        system = rng.choice(SYSTEM_TEMPLATES).format(task=TASK_TYPES[task], topic=rng.choice(TOPICS))
        out.append((task, system))
    return out


class PromptFilter:
    """Quality filter and dedup over normalised text (the seen-set spans a whole run)."""

    def __init__(self, cfg: MagpieConfig, tokenizer, index: NgramIndex | None = None):
        self.cfg, self.index = cfg, index
        self.special = [t for t in tokenizer.convert_ids_to_tokens(sorted(special_token_ids(tokenizer))) if t]
        self.seen: set[str] = set()
        self.counts = {
            "empty_or_cut": 0,
            "special": 0,
            "length": 0,
            "unprintable": 0,
            "duplicate": 0,
            "contaminated": 0,
        }

    def add_seen(self, text: str) -> None:
        self.seen.add(normalise(text))

    def reason(self, text: str, finished: bool = True, quality: bool = True) -> str | None:
        """Why the prompt is rejected (a key of self.counts), or None to keep it.

        quality=False checks only emptiness, duplicates and contamination (data set prompts).
        """
        cfg = self.cfg
        if not text.strip() or (quality and cfg.cut != "keep" and not finished):
            return "empty_or_cut"
        if quality:
            if any(t in text for t in self.special):
                return "special"
            if not cfg.min_words <= len(text.split()) <= cfg.max_words:
                return "length"
            good = sum(ch.isprintable() or ch in "\n\t" for ch in text) - text.count("\ufffd")
            if good < cfg.min_printable * len(text):
                return "unprintable"
        key = normalise(text)
        if key in self.seen:
            return "duplicate"
        if self.index and self.index.matches(text):
            return "contaminated"
        return None

    def accept(self, text: str, finished: bool = True, quality: bool = True) -> bool:
        why = self.reason(text, finished, quality)
        if why is None:
            self.add_seen(text)
            return True
        self.counts[why] += 1
        return False


def magpie_prompts(
    target, n: int, cfg: MagpieConfig, prompt_filter: PromptFilter, seed: int, batch_size: int, desc: str | None = None
) -> list[dict]:
    """n new prompts written by the target: [{"prompt", "category"}], deduplicated and filtered.

    Generates in rounds of oversampled candidates until n are kept or max_rounds is reached.
    """
    tokenizer, model = target.tokenizer, target.model
    stop = end_of_turn_ids(tokenizer, model)
    rng = random.Random(seed)
    kept: list[dict] = []
    for round_ in range(cfg.max_rounds):
        need = n - len(kept)
        if need <= 0:
            break
        count = max(need, int(need * cfg.oversample + 0.999))
        if cfg.conditioned:
            systems = conditioning_systems(count, rng)
        else:
            systems = [("magpie", None)] * count
        prefixes = [user_turn_prefix(tokenizer, [{"role": "system", "content": s}] if s else []) for _, s in systems]
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes]
        # The few oversampled extras ride in the same batch instead of a small batch of their own.
        batch = count if count <= batch_size * 1.25 else batch_size
        outs = generate(
            model,
            ids,
            max_new_tokens=cfg.max_new_tokens,
            stop_ids=stop,
            pad_id=pad_token_id(tokenizer),
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            batch_size=batch,
            seed=rng.randrange(2**31),
            desc=f"{desc} round {round_ + 1}" if desc else None,
        )
        for (task, _), out in zip(systems, outs):
            text, finished = _cut(tokenizer.decode(out.tokens, skip_special_tokens=False), out.finished, cfg)
            if len(kept) < n and prompt_filter.accept(text, finished):
                kept.append({"prompt": text, "category": task})
    return kept


def follow_up_prompts(
    target,
    conversations: list[list[dict]],
    cfg: MagpieConfig,
    prompt_filter: PromptFilter,
    seed: int,
    batch_size: int,
    desc: str | None = None,
) -> list[str | None]:
    """A target-written next user turn for each conversation (None where it was rejected)."""
    tokenizer, model = target.tokenizer, target.model
    rng = random.Random(seed)
    prefixes = [
        user_turn_prefix(tokenizer, [{"role": "system", "content": rng.choice(FOLLOW_UP_SYSTEMS)}] + conversation)
        for conversation in conversations
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes]
    outs = generate(
        model,
        ids,
        max_new_tokens=cfg.max_new_tokens,
        stop_ids=end_of_turn_ids(tokenizer, model),
        pad_id=pad_token_id(tokenizer),
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        batch_size=batch_size,
        seed=rng.randrange(2**31),
        desc=desc,
    )
    result = []
    for out in outs:
        text, finished = _cut(tokenizer.decode(out.tokens, skip_special_tokens=False), out.finished, cfg)
        result.append(text if prompt_filter.accept(text, finished) else None)
    return result


_SENTENCE_END = re.compile(r"[.?!][\"')\]]*(?=\s|$)")


def trim_to_sentence(text: str) -> str:
    """The text up to its last complete sentence ("" when it has none)."""
    ends = list(_SENTENCE_END.finditer(text))
    return text[: ends[-1].end()].strip() if ends else ""


def _cut(text: str, finished: bool, cfg: MagpieConfig) -> tuple[str, bool]:
    text = text.strip()
    if not finished and cfg.cut == "trim":
        return trim_to_sentence(text), True
    return text, finished


def dataset_prompts(path: str, format: str = "auto", split: str = "train") -> list[dict]:
    """The user turns of every row: ShareGPT, OpenAI, FastChat question.jsonl ("turns") or
    {"prompt"|"question"|"instruction"} rows. [{"prompt", "category", "follow_ups"}]: the first
    user turn, and the later ones that answer distill.turns > 1."""
    if path == SHAREGPT_SOURCE and not Path(path).exists():
        return sharegpt_prompts()
    prompts = []
    for where, row in iter_rows(path, split):
        category, follow_ups = "dataset", []
        if isinstance(row, dict) and isinstance(row.get("turns"), list):
            text = row["turns"][0] if row["turns"] else None
            follow_ups = [t for t in row["turns"][1:] if isinstance(t, str)]
            category = str(row.get("category") or category)
        elif isinstance(row, dict) and any(isinstance(row.get(k), str) for k in PROMPT_KEYS):
            text = next(row[k] for k in PROMPT_KEYS if isinstance(row.get(k), str))
        else:
            turns = user_turns(row_to_conversation(row, format, where))
            text, follow_ups = (turns[0], turns[1:]) if turns else (None, [])
        if not isinstance(text, str):
            raise SpecHeadsError(f"{where}: no user prompt found")
        prompts.append({"prompt": text, "category": category, "follow_ups": follow_ups})
    return prompts


def sharegpt_prompts() -> list[dict]:
    """ShareGPT's user turns, from the first piece of each conversation: a later piece of one the
    cleaned split cut up opens mid-dialogue, without the context its first turn refers to."""
    rows, _ = read_sharegpt()
    first = [r for r in rows if r["part"] == 0]
    print(f"sharegpt: {len(first)} conversations open a dialogue ({len(rows) - len(first)} later pieces skipped)")
    prompts = []
    for row in first:
        turns = user_turns(row["messages"])
        prompts.append({"prompt": turns[0], "category": "sharegpt", "follow_ups": turns[1:]})
    return prompts


def pad_token_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise SpecHeadsError("the tokenizer has neither a pad nor an eos token")
    return int(pad)
