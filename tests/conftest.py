import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specheads.decode.drafters import HybridDrafter
from specheads.decode.policy import DynamicTreeSpec
from specheads.decode.tree import chain_paths, full_paths, static_tree
from specheads.numerics import relative_error, same_numbers

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPECHEADS_SHM_ALLREDUCE", "0")  # CPU ranks all-reduce through gloo: no op compile per run
# make test runs the modules on one pytest-xdist worker per core: each worker, and the processes
# its tests start, then keeps to one thread (two loaded threads on one core run tiny matrices ~10x slower)
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)

# The target matrix: specheads.tiny's types of the targets of 2026, by kind. tests/decode/test_targets_matrix.py
# decodes on each of them, tests/test_target_types_commands.py runs the commands on each.
MOE_TYPES = ["qwen3_moe", "mixtral", "deepseek_v3"]
WINDOWED_TYPES = ["gpt_oss", "llama4_text", "gemma3_text", "phi3"]  # sliding-window or chunked layers
DENSE_TYPES = ["olmo2", "smollm3"]
HYBRID_TYPES = ["qwen3_next", "falcon_h1", "granitemoehybrid"]  # a recurrent state beside attention
MATRIX_TYPES = MOE_TYPES + WINDOWED_TYPES + DENSE_TYPES + HYBRID_TYPES

# trees of depth 4 for the lossless-decoding tests
POLICIES = {
    "chain": static_tree(chain_paths(4)),
    "wide": static_tree(full_paths(2, 3)),
    "medusa-like": static_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]),
    "dynamic": DynamicTreeSpec(depth=4, top_k=3, total_tokens=12),
    # a level drafted only while a path into it is likely enough: steps of every depth
    "gated": static_tree([[0], [1], [2], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]], min_path_prob=0.3),
}


# a module asks for it with pytestmark = pytest.mark.usefixtures("one_thread")
@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for the module, then restored: tiny matrices run ~10x slower on two loaded threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world(one_thread):
    """A distributed world of one (gloo, CPU) for the trainer, on one torch thread."""
    from specheads.distributed import setup_distributed

    return setup_distributed("cpu")


@pytest.fixture(scope="module")
def tok():
    """The byte-level tokenizer of the tiny targets."""
    from specheads.tiny import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_target():
    """The tiny random llama (model=tiny-random) on CPU, shared by the session: a test must not change it."""
    from specheads.config.train import ModelConfig
    from specheads.target import load_target

    return load_target(ModelConfig(name="tiny-random", path="tiny:llama"), device=torch.device("cpu"))


def thinking_target(thinking, seed=0):
    """The tiny random llama whose chat template reads enable_thinking (Qwen3's switch), loaded with
    model.thinking=`thinking`: the tiny target's weights, a template that renders otherwise."""
    from specheads.config.model import ModelConfig
    from specheads.target import load_target

    tiny = {"template": "thinking", "seed": seed}
    return load_target(
        ModelConfig(name="tiny-random", path="tiny:llama", tiny=tiny, thinking=thinking), torch.device("cpu")
    )


@pytest.fixture(scope="session")
def smollm2_target():
    from specheads.config.train import ModelConfig
    from specheads.target import load_target

    return load_target(ModelConfig(), device=torch.device("cpu"))


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory):
    """A head directory written by train.py (3 steps on the tiny target), shared by the session
    (tests/test_infer.py, tests/bench/test_replay.py): a test must not change it."""
    out = tmp_path_factory.mktemp("train")
    chats = out / "chats.jsonl"
    words = "the cat sat on a warm mat and the dog ran to the red barn near a river".split()
    write_jsonl(
        chats,
        [
            {
                "messages": [
                    {"role": "user", "content": " ".join(words[i % 7 : i % 7 + 4])},
                    {"role": "assistant", "content": " ".join(words[i % 5 : i % 5 + 10])},
                ]
            }
            for i in range(16)
        ],
    )
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "model=tiny-random",
            "head=eagle3",
            "train.max_steps=3",
            f"output_dir={out / 'run'}",
            f"data.path={chats}",
            "data.max_length=96",
            "data.eval_fraction=0.25",
            "wandb.mode=disabled",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert (path / "config.json").is_file()
    return path


def greedy_sequences(target):
    """The target's greedy 40-token continuations of 8 random 8-token prompts (seed 0): text to overfit heads on."""
    prompts = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(0)).to(target.device)
    return target.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=40, do_sample=False)


@pytest.fixture(scope="module")
def sequences(tiny_target):
    """greedy_sequences of the shared tiny target, once per module."""
    return greedy_sequences(tiny_target)


@pytest.fixture
def toy_batch():
    """Two right-padded sequences with an assistant span, fixed seed."""
    g = torch.Generator().manual_seed(0)
    b, t = 2, 40
    ids = torch.randint(0, 256, (b, t), generator=g)
    attention = torch.ones(b, t, dtype=torch.long)
    attention[1, 30:] = 0
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask[:, 10:] = 1
    loss_mask[1, 30:] = 0
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def batch_rows(batch):
    return [{"input_ids": i.tolist(), "loss_mask": m.tolist()} for i, m in zip(batch["input_ids"], batch["loss_mask"])]


def head_states(target, head, batch):
    layer_ids, final = head.training_states()
    s = target.states(batch["input_ids"], batch["attention_mask"], layer_ids=layer_ids, final=final)
    return {**s.hidden, "final": s.final}


def loss_and_lm_head_rows(head, batch, states):
    """head.loss(batch, states), and how many rows each call of the target's LM head read in it."""
    rows = []
    hook = head.frozen.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    try:
        loss, metrics = head.loss(batch, states)
    finally:
        hook.remove()
    return loss, metrics, rows


def overfit(head, batch, states, steps, lr=3e-3):
    """`steps` AdamW steps on the head's loss over one batch: the loss of every step and the last metrics."""
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    losses, metrics = [], {}
    for _ in range(steps):
        loss, metrics = head.loss(batch, states)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, metrics


def hf_greedy(target, prompt, n, eos=None):
    """The target's own greedy continuation (transformers generate): n new token ids."""
    kwargs = {} if eos is None else {"eos_token_id": eos}
    out = target.model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, **kwargs
    )
    return out[0, prompt.shape[1] :].tolist()


# quick_head's trained heads, one per target, family, sequences and step count:
# (target, family, steps, sequences, head, torch's RNG states after its training)
TRAINED_HEADS: list = []


def rng_states():
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def quick_head(target, family, sequences=None, steps=0):
    """A head of `family` on `target`, optionally overfitted on `sequences` for `steps` steps.
    A trained head is trained once per session (TRAINED_HEADS): every call gets its own copy,
    attached to the target as a fresh head is, and leaves torch's RNG where the training left it."""
    from specheads.config.train import HeadConfig
    from specheads.heads import build_head

    for t, f, n, seqs, trained, (cpu, cuda) in TRAINED_HEADS if steps else ():
        if (
            t is target
            and f == family
            and n == steps
            and seqs.shape == sequences.shape
            and torch.equal(seqs, sequences)
        ):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            return copy.deepcopy(trained).attach(target)
    torch.manual_seed(0)
    rows = [{"input_ids": list(range(320)), "loss_mask": [1] * 320}]
    # eagle3 with a reduced draft vocab: the d2t mapping is exercised
    head = build_head(
        HeadConfig(family=family, draft_vocab_size=200, ttt_steps=2, num_heads=4, anchors_per_sequence=16),
        target,
        train_rows=rows,
    )
    if steps:
        batch = {
            "input_ids": sequences,
            "attention_mask": torch.ones_like(sequences),
            "loss_mask": torch.ones_like(sequences),
        }
        states = head_states(target, head, batch)
        head.train()
        overfit(head, batch, states, steps)
        if not head.adapts_target:  # a Medusa-2 head's adapter lives in the target: trained afresh
            TRAINED_HEADS.append((target, family, steps, sequences.clone(), copy.deepcopy(head.eval()), rng_states()))
    return head.eval()


def random_requests(seed, vocab_max=6, prompt_max=12, answer_max=20):
    """1-3 requests over a small vocabulary (so that the text repeats), for the text drafter and the
    calibration's walks: (rng, prompts, prompt + answer contexts), answers of 2 tokens or more."""
    rng = random.Random(seed)
    vocab = rng.randint(2, vocab_max)
    prompts, contexts = [], []
    for _ in range(rng.randint(1, 3)):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, prompt_max))]
        prompts.append(ids)
        contexts.append(ids + [rng.randrange(vocab) for _ in range(rng.randint(2, answer_max))])
    return rng, prompts, contexts


def tree_accepts(tokens, layout, truth):
    """Drafts a tree accepts along `truth` under greedy verification: walk down while a child
    carries the next true token."""
    node, k = 0, 0
    while k < len(truth):
        node = next((c for c in layout.children[node] if tokens[c] == truth[k]), None)
        if node is None:
            break
        k += 1
    return k


def along_answer(drafter, target, full, start, step):
    """step(drafter, r) at each answer position r of `full` (the answer from `start`), the drafter
    fed one true token at a time as in decoding, with the target's states of one forward."""
    seq = torch.tensor([full])
    with target.capture(drafter.layer_ids, final=drafter.reads_final) as store:
        target.model(seq)
    states = dict(store)
    drafter.start(seq[:, :start], {k: v[:, :start] for k, v in states.items()}, full[start])
    out = []
    for r in range(start, len(full) - 1):
        out.append(step(drafter, r))
        drafter.advance({k: v[:, r : r + 1] for k, v in states.items()}, [full[r]], full[r + 1])
    return out


def write_jsonl(path, rows):
    """`rows` as JSON lines at `path`; returns path."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def conversations(n, offset=0):
    """n OpenAI-format chats of one exchange: "question number i" / "answer number i", i from offset."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"question number {i}"},
                {"role": "assistant", "content": f"answer number {i}"},
            ]
        }
        for i in range(offset, offset + n)
    ]


def write_conversations(path, n=24, seed=0):
    """n seeded random OpenAI-format chats (short, byte-tokenized by the tiny target) at `path`; returns path."""
    rng = random.Random(seed)
    words = "the cat dog sun moon tree river stone blue red runs sleeps over under near far".split()
    rows = []
    for _ in range(n):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 6)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(8, 16)))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return write_jsonl(path, rows)


def write_questions(path, prompts, categories=("writing",), first_id=0, later_turns=("Shorter now.",)):
    """A FastChat question.jsonl: question first_id + i asks prompts[i], then later_turns; categories in turn."""
    rows = [
        {"question_id": first_id + i, "category": categories[i % len(categories)], "turns": [p, *later_turns]}
        for i, p in enumerate(prompts)
    ]
    return write_jsonl(path, rows)


def assert_same_numbers(actual, expected, dtype=None):
    """The product's own rule for two float computations of the same numbers (specheads.numerics:
    the largest difference relative to the magnitude, the dtype's tolerance), which holds whatever
    order this machine's kernels sum in."""
    __tracebackhide__ = True
    if not same_numbers(actual, expected, dtype):
        raise AssertionError(f"not the same numbers: relative error {relative_error(actual, expected):.3g}")


def assert_other_numbers(actual, expected, dtype=None):
    """A wrong variant is caught by the same rule: further apart than the tolerance."""
    __tracebackhide__ = True
    if same_numbers(actual, expected, dtype):
        raise AssertionError(f"the same numbers (relative error {relative_error(actual, expected):.3g})")


def fails_for_some_seed(check, variant, seeds) -> bool:
    """Whether check(variant, seed) raises AssertionError for at least one seed: a property check
    shown able to fail on a deliberately wrong variant."""
    for seed in seeds:
        try:
            check(variant, seed)
        except AssertionError:
            return True
    return False


def assert_first_two_tokens_follow(counts, p1, p2, n):
    """`counts` of the first two sampled tokens over `n` runs against the target's joint
    distribution p1[a] * p2[a, b]: nothing sampled outside its support, and a chi-square test over
    the cells expected at least 5 times (the rest pooled) with p-value > 0.01."""
    from scipy.stats import chisquare

    vocab = p1.numel()
    joint = (p1[:, None] * p2).flatten().cpu()
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for idx in range(joint.numel()):
        key = (idx // vocab, idx % vocab)
        e = float(joint[idx]) * n
        if e == 0:
            assert counts[key] == 0
        elif e < 5:
            rest_o += counts[key]
            rest_e += e
        else:
            obs.append(counts[key])
            exp.append(e)
    obs.append(rest_o)
    exp.append(rest_e)
    exp = [e * sum(obs) / sum(exp) for e in exp]
    assert chisquare(obs, exp).pvalue > 0.01


class PlantedText(HybridDrafter):
    """A hybrid drafter whose text starts with `planted` (e.g. the prompt and the reference answer,
    some of its tokens changed) before the real prompt: the text's repeats are found there with the
    true continuation after them, so text nodes get accepted (and rejected) at random places."""

    def __init__(self, inner, policy, planted):
        super().__init__(inner, policy)
        self.planted = planted

    def start(self, prompt_ids, states, root):
        super().start(prompt_ids, states, root)
        self.index.start_request(self.planted + prompt_ids[0].tolist())
        self.index.extend([int(root)])


def leaves_one_drafted_entry(base):
    """A wrong variant of a drafter that runs the target's own layers on its KV cache (early exit,
    layer skipping): those layers keep one drafted entry (the root's) when the target verifies."""

    def draft(self, root, prefix_len, max_depth):
        from specheads.decode import drafters

        real = drafters.crop_layers
        drafters.crop_layers = lambda cache, layers, length: real(cache, layers, length + 1)
        try:
            return base.draft(self, root, prefix_len, max_depth)
        finally:
            drafters.crop_layers = real

    return type(
        f"LeavesItsDrafts{base.__name__}", (base,), {"draft": draft, "__doc__": leaves_one_drafted_entry.__doc__}
    )


def run_script(script: str, *args: str, cwd: Path = ROOT) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python SCRIPT ARGS` (or `python -m MODULE ARGS` for
    script "-m MODULE") run from `cwd`, in this process (runpy: the command's own __main__ and
    one-line errors, without a new interpreter's start-up); an exception that escapes it is written
    to stderr as Python would, status 1."""
    import contextlib
    import io
    import runpy
    import traceback

    from hydra.core.global_hydra import GlobalHydra

    argv, here = sys.argv, os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        os.chdir(cwd)
        module = script[3:] if script.startswith("-m ") else None
        sys.argv = [module or script, *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if module:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(str(ROOT / script), run_name="__main__")
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
        os.chdir(here)
        GlobalHydra.instance().clear()
    return code, out.getvalue(), err.getvalue()
