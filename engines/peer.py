"""`make peer`: our EAGLE-3 trainer against vLLM's speculators trainer, on the same rows and budget.

    .venv/bin/python engines/peer.py [--steps 100] [--seeds 0 1] [--batch-size 2] [--lr 5e-4]
                                    [--questions Q.jsonl ...] [--out runs/peer] [train.py overrides ...]
    .venv/bin/python engines/peer.py ...the same settings... --recipe NAME OVERRIDE [OVERRIDE ...]

A development tool of the repository, beside compare.py. For each seed (the heads' initialisation;
the rows' order is --data-seed for all, so every seed trains on the very same steps):

1. rows: the training rows exactly as train.py builds them (the same Hydra config, tokenization,
   loss masks, packing and order: specheads.train.batches.training_order), and the draft
   vocabulary of the head train.py builds on them;
2. the peer's data (write_peer_data): those conversations as the Arrow data set speculators reads
   (input_ids, loss_mask, seq_len), each one's hidden states as `hidden_states/hs_{i}.safetensors`
   ([T, 4, H]: the residual stream entering layers 2, 15, 27, then the last layer's output before
   the final norm, from the target's own forward), the draft vocabulary as d2t.npy / t2d.npy, and
   the schedule: per optimizer step, the conversations our trainer reads at that step;
3. the peer trains (engines/peer_train.py, in vLLM's virtualenv) on that schedule, and train.py
   trains ours on the same rows, with the same architecture (1 layer, layers 2/15/27, draft
   vocabulary 8192, TTT 3 with decay 0.8), tokens a step, steps, AdamW (0.9, 0.999), clip 1.0,
   learning rate and cosine schedule to 0, fp32 states;
4. both heads are replayed exactly (`infer.py bench.mode=replay`: chains of 1-8 and the best trees
   of 1-16 nodes) on each question set given;
5. both run in vLLM's CPU build at a chain of --vllm-k (engines/compare.py: ours exported, the
   peer's as its trainer wrote it), for vLLM's acceptance counters beside infer.py's.

It writes OUT/peer.json (every figure), OUT/peer.md (the tables), OUT/peer.png (acceptance against K
for both heads, each seed) and OUT/peer_categories.png (the per-category test of "better" as bars).
What cannot be matched is listed in the output (UNMATCHED). Each result is kept in OUT with a
record of what made it (settings.json: ours' train.py overrides, the peer's data settings and
command, a replay's questions and answer length, vLLM's command and K); a rerun reuses it only when
every one of those is the same and it is newer than what it was made from, else makes it again.

--recipe NAME OVERRIDE...: a recipe of ours against the peer's heads already trained in OUT at the
same settings. Only ours trains, with these train.py overrides on top of the matched ones (the same
rows and order), into OUT/recipes/NAME/seed-S; it is replayed on the same answers (the comparison's
greedy answers are reused, and the peer's replay report where it has one), and OUT/recipes/NAME/peer.md
is the same report with the recipe as "ours": parity, and the per-category test of "better".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specheads.atomic import atomic_path, save_figure, write_json, write_text
from specheads.errors import SpecHeadsError, one_line_errors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engines"))
from compare import run_logged  # noqa: E402  (the sibling tool's runner: output to a log, one line on failure)

RUNNER = ROOT / "engines" / "peer_train.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
LAYERS = [2, 15, 27]
# The data of the shipped head's recipe (docs/shipped-head.md), at 512-token rows, packed.
DATA = [
    "data.path=data/sharegpt_smollm2_135m",
    "data.mix=[data/smollm2_diverse_256,data/smollm2_selfdistill_23k.jsonl.gz]",
    "data.partial_distill=true",
    "data.max_repeat_rate=0.5",
    "data.max_length=512",
    "data.pack=true",
    "data.features=null",
]
# What differs between the two trainers: (ours' train.py override that matches it, or None, why)
UNMATCHED = [
    (
        "head.loss_positions=all",
        "loss: the peer's KL on every masked position; ours drops positions whose target top token lies "
        "outside the draft vocabulary",
    ),
    (
        "head.freeze_lm_head=true",
        "LM head: the peer freezes the draft LM head at the target's rows; ours trains it from those rows",
    ),
    (None, "final norm: the peer starts it at 1; ours starts from the target's final norm"),
    (None, "schedule: the peer's first step runs at learning rate 0 (its warm-up counts from 0); ours at lr/warmup"),
    (
        None,
        "packing: the same conversations every step; the peer packs them into one row of batch_size x "
        "max_length tokens, ours into batch_size rows of max_length",
    ),
]


BETTER = 0.05  # the issue's "better": ours' chain-3 tau ahead of the peer's by this share in a category


def unmatched(overrides: list[str]) -> list[str]:
    """The differences left between the two trainers, given ours' train.py overrides."""
    return [why for match, why in UNMATCHED if match is None or match not in overrides]


def our_overrides(args, seed: int) -> list[str]:
    """train.py's settings for this comparison (beside the data): the peer's fixed choices matched."""
    return [
        "model=smollm2-135m",
        "head=eagle3",
        f"head.layer_ids=[{','.join(map(str, LAYERS))}]",
        "head.draft_vocab_size=8192",
        "head.ttt_steps=3",
        "head.ttt_decay=0.8",
        *DATA,
        f"train.max_steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.lr={args.lr}",
        f"train.warmup_steps={args.warmup}",
        "train.min_lr_ratio=0",
        "train.betas=[0.9,0.999]",
        "train.grad_clip=1.0",
        "train.weight_decay=0",
        "train.eval_every=0",
        "train.save_every=0",
        f"seed={seed}",
        f"data_seed={args.data_seed}",
        *args.overrides,
    ]


def compose(overrides: list[str]):
    """The TrainJobConfig train.py composes from these overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from specheads.config import register_configs, typed

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return typed(hydra_compose(config_name="config", overrides=overrides))


def step_schedule(cfg, train_rows) -> list[list[int]]:
    """Per optimizer step, the training conversations train.py reads at that step, in its order."""
    from specheads.data.datasets import row_lengths
    from specheads.train.batches import training_order

    packs, batches = training_order(cfg, row_lengths(train_rows), rank=0, world_size=1)
    steps = []
    for step in range(cfg.train.max_steps):
        rows = []
        for micro in range(cfg.train.grad_accum):
            for r in batches[step * cfg.train.grad_accum + micro]:
                rows.extend(packs[r] if packs is not None else [r])
        steps.append(rows)
    return steps


def peer_states(target, input_ids):
    """[T, 4, H] float32: what the peer reads for one conversation (vLLM's aux layers, then the
    last layer's output before the final norm, our layer id L), from the target's own forward."""
    import torch

    every = [*LAYERS, target.info.num_layers]
    states = target.states(torch.tensor([input_ids]), layer_ids=every, final=False)
    return torch.stack([states.hidden[k][0].float() for k in every], dim=1)


def states_written(path: Path, ids: list[int]) -> bool:
    """Whether a conversation's states file is already whole and of these very tokens (a file cut
    short by a killed run, or one of other rows, is written again)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return f.get_tensor("token_ids").tolist() == ids and "hidden_states" in f.keys()
    except (SafetensorError, OSError):
        return False


def write_peer_data(
    out: Path, target, train_rows, eval_rows, schedule, head, dtype="float32", shared: list[Path] = ()
) -> dict:
    """The peer's data directory (see the module's docstring); its summary. `shared`: other seeds'
    hidden_states directories; a conversation's file there, whole and of the same tokens, is linked
    rather than written again (the states are the target's, whatever the seed)."""
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from tqdm import tqdm

    rows = [*train_rows, *eval_rows]
    arrow = Dataset.from_dict(
        {
            "input_ids": [list(r["input_ids"]) for r in rows],
            "loss_mask": [list(r["loss_mask"]) for r in rows],
            "seq_len": [len(r["input_ids"]) for r in rows],
        }
    )
    arrow.set_format("torch")  # speculators compares a row's input_ids with its states' token_ids as tensors
    arrow.save_to_disk(str(out))
    used = sorted({i for step in schedule for i in step} | set(range(len(train_rows), len(rows))))
    states_dir = out / "hidden_states"
    states_dir.mkdir(parents=True, exist_ok=True)
    for i in tqdm(used, desc="peer: hidden states", unit="conv"):
        ids, path = list(rows[i]["input_ids"]), states_dir / f"hs_{i}.safetensors"
        if states_written(path, ids):  # an interrupted run's file: resumed, not redone
            continue
        twin = next((d / path.name for d in shared if states_written(d / path.name, ids)), None)
        if twin is not None:
            with atomic_path(path) as tmp:
                tmp.unlink()  # the placeholder, for the link
                os.link(twin, tmp)
            continue
        states = peer_states(target, ids).to(getattr(torch, dtype)).contiguous()
        with atomic_path(path) as tmp:
            save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(tmp))
    np.save(out / "d2t.npy", head.d2t.cpu().numpy())
    np.save(out / "t2d.npy", head.t2d.cpu().numpy())
    plan = {"train_rows": len(train_rows), "rows": len(rows), "batches": schedule}
    write_json(out / "schedule.json", plan)
    tokens = sum(len(rows[i]["input_ids"]) for step in schedule for i in step)
    return {"rows": len(rows), "train_rows": len(train_rows), "states_written": len(used), "tokens": tokens}


def prepare(args, seed: int, out: Path) -> dict:
    """Steps 1 and 2 for one seed: our rows, order and draft vocabulary; the peer's data from them."""
    from specheads.distributed import process_group
    from specheads.heads import build_head
    from specheads.target import load_target, resolve_device
    from specheads.train.run import data_splits

    cfg = compose(our_overrides(args, seed))
    with process_group("cpu") as d:
        target = load_target(cfg.model, resolve_device("cpu"))
        splits = data_splits(cfg.data, target, d)
    train_rows = splits["train"]
    eval_rows = list(splits["eval"])[: args.eval_rows]
    head = build_head(cfg.head, target, train_rows=train_rows)
    schedule = step_schedule(cfg, train_rows)
    shared = [d for d in out.parent.glob("seed-*/data/hidden_states") if d.parent.parent != out]
    summary = write_peer_data(out / "data", target, train_rows, eval_rows, schedule, head, shared=shared)
    verifier = out / "verifier"
    if not (verifier / "config.json").is_file():  # the peer reads the target's embedding, norm, LM head
        target.model.save_pretrained(verifier)
        target.tokenizer.save_pretrained(verifier)
    return {**summary, "verifier": str(verifier), "max_length": cfg.data.max_length}


def split_ratio(train_rows: int, rows: int) -> float:
    """The --train-data-ratio at which speculators' split, int(rows x ratio) (its ArrowDataset), keeps
    exactly the first train_rows of `rows`: (train_rows + 1/2) / rows.

    Exactly, rows x ratio is train_rows + 1/2, half a row from either integer. In floating point the
    division and speculators' product each round by a factor (1 + d), |d| <= 2^-53 (repr() carries the
    ratio through the command line exactly), so the product is (train_rows + 1/2)(1 + e) with
    |e| <= 2^-52 + 2^-106: off by less than 1/2 while train_rows < 2^50, and int() gives train_rows.
    0 < ratio < 1, which speculators requires, as rows > train_rows > 0. The ratio train_rows / rows
    itself would do only where it is exact: printed to 12 decimals it falls short for about half
    of all counts (1000 of 1008: int(999.9999999995) = 999 rows)."""
    if not 0 < train_rows < rows < 2**50:
        raise SpecHeadsError(f"the peer's data needs training rows and held-out ones: {train_rows} of {rows}")
    return (train_rows + 0.5) / rows


def peer_command(args, seed: int, out: Path, data: dict) -> list[str]:
    ratio = split_ratio(data["train_rows"], data["rows"])
    return [
        str(VLLM_PYTHON),
        str(RUNNER),
        str(out / "data" / "schedule.json"),
        "--",
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", data["verifier"],
        "--num-layers", "1", "--full-attention-indices", "0",
        "--target-layer-ids", *map(str, LAYERS),
        "--draft-vocab-size", "8192",
        "--d2t-path", str(out / "data" / "d2t.npy"), "--t2d-path", str(out / "data" / "t2d.npy"),
        "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
        "--ttt-steps", "3", "--ttt-step-loss-decay", "0.8",
        "--data-path", str(out / "data"), "--train-data-ratio", repr(ratio), "--on-missing", "raise",
        "--total-seq-len", str(args.batch_size * data["max_length"]),
        "--hidden-states-dtype", "float32", "--num-workers", "0",
        "--epochs", "1", "--lr", str(args.lr), "--optimizer", "adamw", "--weight-decay", "0",
        "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(args.warmup),
        "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
        "--save-path", str(out / "peer"), "--seed", str(seed),
    ]  # fmt: skip


def peer_head(out: Path) -> Path | None:
    """The peer's saved head (speculators format): its last epoch's directory, SAVE/<epoch>/."""
    epochs = [p.parent for p in (out / "peer").glob("*/config.json") if p.parent.name.isdigit()]
    return max(epochs, key=lambda p: int(p.name)) if epochs else None


SETTINGS = "settings.json"  # beside a kept result (a head, a report): every setting that shaped it


def kept(record: Path, settings) -> bool:
    """Whether the result `record` belongs to was made with these very settings (its record says so)."""
    return record.is_file() and json.loads(record.read_text()) == json.loads(json.dumps(settings))


def made_again(directory: Path) -> None:
    """A result made again starts from nothing: both trainers resume from what they find there."""
    if directory.exists():
        shutil.rmtree(directory)


def train_ours(out: Path, overrides: list[str], env: dict) -> None:
    """Ours trained into out/ours with these train.py overrides, recorded beside its head."""
    made_again(out / "ours")
    cmd = [sys.executable, "train.py", f"output_dir={out / 'ours'}", *overrides]
    run_logged("train.py", cmd, out / "ours.log", env)
    write_json(out / "ours" / SETTINGS, overrides)


def peer_settings(args, seed: int, out: Path, data: dict) -> dict:
    """What the peer's head of one seed is trained from: its data's settings and its command."""
    return {"data": data_settings(args, seed), "command": peer_command(args, seed, out, data)[2:]}


def kept_peer(args, seed: int, out: Path, data: dict) -> bool:
    """Whether out/peer holds the peer's head of these settings, trained since its data was written."""
    return (
        kept(out / "peer" / SETTINGS, peer_settings(args, seed, out, data))
        and peer_head(out) is not None
        and newest_write(out / "peer", deep=True) > newest_write(out / "data")
    )


def train_peer(args, seed: int, out: Path, data: dict, env: dict) -> None:
    made_again(out / "peer")
    run_logged("the peer's training", peer_command(args, seed, out, data), out / "peer.log", env)
    write_json(out / "peer" / SETTINGS, peer_settings(args, seed, out, data))


def replay_settings(questions: Path, max_new_tokens: int) -> dict:
    """What a replay report is made from besides its heads: the questions' bytes and the answer length."""
    return {"questions_sha256": hashlib.sha256(questions.read_bytes()).hexdigest(), "max_new_tokens": max_new_tokens}


def replay(heads: dict[str, Path], questions: Path, out: Path, max_new_tokens: int) -> dict:
    """Exact replay of every head on one question set: {name: its report}."""
    names = list(heads)
    first, others = heads[names[0]], [str(heads[n]) for n in names[1:]]
    stem = out / f"replay-{questions.stem}"
    settings = replay_settings(questions, max_new_tokens)
    kept_report = replayed(stem, heads, settings)
    if kept_report is not None:  # a resumed comparison: these heads were replayed on this set already
        return kept_report
    Path(f"{stem}.{SETTINGS}").unlink(missing_ok=True)  # the report is about to change
    cmd = [
        sys.executable, "infer.py", "model=smollm2-135m", f"head={first}", "bench.mode=replay",
        f"bench.heads=[{','.join(others)}]", f"bench.questions={questions}",
        f"bench.max_new_tokens={max_new_tokens}", f"bench.output={stem}.jsonl",
    ]  # fmt: skip
    run_logged("replay", cmd, out / f"replay-{questions.stem}.log")
    write_json(Path(f"{stem}.{SETTINGS}"), settings)
    return replayed(stem, heads, settings, fresh=True)


def vllm_acceptance(heads: dict[str, Path], out: Path, k: int) -> dict:
    """vLLM's acceptance counters for both heads at a chain of K (`make engines`' questions, 128 new
    tokens): ours exported as eagle3, the peer's directory as its trainer wrote it (compare.py
    --given), each beside infer.py's reading of the same head. {name: its row of compare.py's report};
    kept while the heads are older and the command (K, heads) is the same."""
    report = out / "engines.json"
    cmd = [sys.executable, str(ROOT / "engines" / "compare.py"), "--k", str(k), "--formats", "eagle3"]
    cmd += ["--peers", "--eagle3-head", str(heads["ours"]), "--given", f"peer={heads['peer']}"]
    cmd += ["--max-new-tokens", "128", "--out", str(out)]
    if not (written_after(report, heads) and kept(out / SETTINGS, cmd[1:])):
        (out / SETTINGS).unlink(missing_ok=True)
        run_logged("engines/compare.py", cmd, out / "compare.log")
        write_json(out / SETTINGS, cmd[1:])
    rows = {r["run"]: r for r in json.loads(report.read_text())["rows"]}
    keep = ("identical", "vllm_acceptance", "infer_acceptance", "agree")
    return {name: {f: rows[run].get(f) for f in keep} for name, run in (("ours", "eagle3"), ("peer", "peer"))}


def newest_write(*dirs: Path, deep: bool = False) -> float:
    """The newest modification time of the files in these directories (and below them when deep); 0
    when there are none."""
    files = (f for d in dirs for f in (Path(d).rglob("*") if deep else Path(d).iterdir()) if f.is_file())
    return max((f.stat().st_mtime for f in files), default=0.0)


def written_after(path: Path, heads: dict[str, Path]) -> bool:
    """Whether the file `path` exists and was written after every file of these heads (a result of them)."""
    return path.is_file() and path.stat().st_mtime > newest_write(*heads.values())


def replayed(stem: Path, heads: dict[str, Path], settings: dict, fresh: bool = False) -> dict | None:
    """{name: its report} from the replay report STEM.replay.json of these very heads, written after
    their weights and recorded with these settings; None when there is none such (unless `fresh`:
    then it must be)."""
    path = Path(f"{stem}.replay.json")
    if not (fresh or (written_after(path, heads) and kept(Path(f"{stem}.{SETTINGS}"), settings))):
        return None
    report = json.loads(path.read_text())
    by_dir = {str(Path(h["head"]).resolve()): h for h in report["heads"].values()}
    wanted = {name: str(Path(head).resolve()) for name, head in heads.items()}
    if fresh or all(d in by_dir for d in wanted.values()):
        return {name: by_dir[d] for name, d in wanted.items()}
    return None


@one_line_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps of each trainer")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--data-seed",
        type=int,
        default=0,
        help="the seed of the rows' order, the same for every seed: the seeds then vary the two heads' "
        "initialisation on the very same steps, and the hidden states are written once",
    )
    p.add_argument("--batch-size", type=int, default=2, help="packed rows of data.max_length a step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--eval-rows", type=int, default=8, help="held-out conversations the peer validates on")
    p.add_argument("--questions", type=Path, nargs="*", default=[], help="question sets to replay on")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "peer")
    p.add_argument(
        "--vllm-k",
        type=int,
        default=3,
        help="also run both heads in vLLM's CPU build at this chain length (its acceptance counters); 0: not",
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="train ours while the peer's hidden states are written and the peer trains, each on half "
        "the cores (the two trainers share nothing; acceptance is compared, not speed)",
    )
    p.add_argument(
        "--recipe",
        nargs="+",
        metavar="NAME_THEN_OVERRIDES",
        help="NAME and train.py overrides for ours only: train that recipe and compare it with the peer's "
        "heads kept in OUT (put it after the other options)",
    )
    p.add_argument("overrides", nargs="*", help="train.py overrides for both (data.*, ...)")
    args = p.parse_args(argv)
    if not VLLM_PYTHON.is_file():
        raise SpecHeadsError(f"{VLLM_PYTHON} is missing: make peer builds it (vLLM's CPU build and speculators)")
    results = {
        "unmatched": unmatched(args.overrides),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "runs": {},
    }
    env = {"PYTHONPATH": str(ROOT)}  # beside this process's environment (run_logged)
    if args.recipe:
        return recipe_main(args, results, env)
    peer_env = {**env, "WANDB_MODE": "disabled"}
    if args.concurrent:  # two halves of the cores: this process (states, the peer), and ours' train.py
        import torch

        half = max(1, (os.cpu_count() or 2) // 2)
        torch.set_num_threads(half)
        env, peer_env = ({**e, "OMP_NUM_THREADS": str(half)} for e in (env, peer_env))
    for seed in args.seeds:
        out = args.out / f"seed-{seed}"
        out.mkdir(parents=True, exist_ok=True)
        ours_trained = None
        with ThreadPoolExecutor(max_workers=1) as pool:
            # every kept result is reused only when made with every setting of this run, else made again
            if not kept(out / "ours" / SETTINGS, our_overrides(args, seed)):
                print(f"peer: seed {seed}: ours trains {args.steps} steps", file=sys.stderr)
                ours_trained = pool.submit(train_ours, out, our_overrides(args, seed), env)
                if not args.concurrent:
                    ours_trained.result()
            data = peer_data(args, seed, out)
            if not kept_peer(args, seed, out, data):
                print(f"peer: seed {seed}: the peer trains {args.steps} steps", file=sys.stderr)
                train_peer(args, seed, out, data, peer_env)
            if ours_trained is not None:
                ours_trained.result()  # its failure is raised here, as one line
        heads = {"ours": out / "ours" / "head", "peer": peer_head(out)}
        if heads["peer"] is None:
            raise SpecHeadsError(f"the peer wrote no head under {out / 'peer'}; its output: {out / 'peer.log'}")
        results["runs"][str(seed)] = {"data": data, "heads": {k: str(v) for k, v in heads.items()}, "replay": {}}
        for questions in args.questions:
            print(f"peer: seed {seed}: replay on {questions.name}", file=sys.stderr)
            results["runs"][str(seed)]["replay"][questions.stem] = replay(heads, questions, out, args.max_new_tokens)
        if args.vllm_k:
            print(f"peer: seed {seed}: both heads in vLLM at K={args.vllm_k}", file=sys.stderr)
            results["runs"][str(seed)]["vllm"] = vllm_acceptance(heads, out / "vllm", args.vllm_k)
        write_report(results, args.out)  # after every seed: a long comparison shows what it has
    return 0


def recipe_main(args, results: dict, env: dict) -> int:
    """--recipe: ours trained with the recipe's overrides, against the peer's kept heads (see the
    module's docstring). The report is the comparison's, with the recipe's head as ours."""
    name, extra = args.recipe[0], args.recipe[1:]
    if "=" in name or not extra:
        raise SpecHeadsError("--recipe takes a name, then the train.py overrides that make the recipe")
    root = args.out / "recipes" / name
    results.update(recipe={"name": name, "overrides": extra}, unmatched=unmatched([*args.overrides, *extra]))
    for seed in args.seeds:
        base, out = args.out / f"seed-{seed}", root / f"seed-{seed}"
        data = kept_peer_data(args, seed, base)
        if data is None or not kept_peer(args, seed, base, data):
            raise SpecHeadsError(f"no peer head of these settings under {base}: run the comparison first")
        overrides = [*our_overrides(args, seed), *extra]
        if not kept(out / "ours" / SETTINGS, overrides):
            print(f"peer: recipe {name}, seed {seed}: ours trains, the matched settings and {' '.join(extra)}",
                  file=sys.stderr)  # fmt: skip
            train_ours(out, overrides, env)
        peer = peer_head(base)
        heads = {"ours": out / "ours" / "head", "peer": peer}
        results["runs"][str(seed)] = {"heads": {k: str(v) for k, v in heads.items()}, "replay": {}}
        for questions in args.questions:
            print(f"peer: recipe {name}, seed {seed}: replay on {questions.name}", file=sys.stderr)
            results["runs"][str(seed)]["replay"][questions.stem] = replay_beside(heads, questions, base, out, args)
        if args.vllm_k:
            print(f"peer: recipe {name}, seed {seed}: both heads in vLLM at K={args.vllm_k}", file=sys.stderr)
            results["runs"][str(seed)]["vllm"] = vllm_acceptance(heads, out / "vllm", args.vllm_k)
        write_report(results, root)
    return 0


def replay_beside(heads: dict[str, Path], questions: Path, base: Path, out: Path, args) -> dict:
    """A recipe's replay in `out`: the target's greedy answers of the comparison's run in `base` are
    reused (the replay checks they are this target's, with these kernels and prompts), and so is the
    peer head's report there; only what has none is replayed."""
    answers = f"replay-{questions.stem}.greedy.jsonl"
    if (base / answers).is_file() and not (out / answers).exists():
        with atomic_path(out / answers) as tmp:
            tmp.write_bytes((base / answers).read_bytes())
    peer = {"peer": heads["peer"]}
    settings = replay_settings(questions, args.max_new_tokens)
    peers_report = replayed(base / f"replay-{questions.stem}", peer, settings) or {}
    return {**replay({k: v for k, v in heads.items() if k not in peers_report}, questions, out, args.max_new_tokens),
            **peers_report}  # fmt: skip


def data_settings(args, seed: int) -> dict:
    """What the peer's data of one seed is written from (kept beside it, to tell whether it is reused)."""
    # schedule: schedule.json's layout, 2 since it names the data set's rows (data of layout 1 is written again)
    return {"overrides": our_overrides(args, seed), "eval_rows": args.eval_rows, "schedule": 2}


def kept_peer_data(args, seed: int, out: Path) -> dict | None:
    """The summary of the peer's data kept in `out` for these settings; None if there is none such."""
    done = out / "data" / "summary.json"
    if done.is_file() and json.loads(done.read_text())["settings"] == data_settings(args, seed):
        return json.loads(done.read_text())["data"]
    return None


def peer_data(args, seed: int, out: Path) -> dict:
    """The peer's data for one seed, kept and reused when run again with the same settings."""
    if (kept := kept_peer_data(args, seed, out)) is not None:
        return kept
    print(f"peer: seed {seed}: rows, order and hidden states", file=sys.stderr)
    data = prepare(args, seed, out)
    write_json(out / "data" / "summary.json", {"settings": data_settings(args, seed), "data": data})
    return data


def seed_means(by_head: dict[str, list[float]]) -> dict | None:
    """{seeds, ours, peer, spread}: one measure's mean over the seeds for each head and the spread of
    ours (max - min; 0 with one seed); None unless both heads have it for the same seeds."""
    ours, theirs = by_head.get("ours", []), by_head.get("peer", [])
    if not ours or len(ours) != len(theirs):
        return None
    return {"seeds": len(ours), "ours": sum(ours) / len(ours), "peer": sum(theirs) / len(theirs),
            "spread": max(ours) - min(ours)}  # fmt: skip


def parity(results: dict, k: str = "3") -> list[dict]:
    """The issue's parity test, per measure (each question set's replayed chain-K tau, and vLLM's kept
    acceptance length): ours' mean over the seeds against the peer's mean less the spread of ours
    (max - min over the seeds; 0 with one seed). {measure, seeds, ours, peer, spread, holds}."""
    measures: dict[str, dict[str, list[float]]] = {}
    for run_ in results["runs"].values():
        for qset, heads in run_["replay"].items():
            for name, report in heads.items():
                measures.setdefault(f"{qset} chain {k}", {}).setdefault(name, []).append(report["chain_tau"][k])
        for name, row in (run_.get("vllm") or {}).items():
            accepted = row["vllm_acceptance"] or {}
            kept = accepted.get("kept_acceptance_length", accepted.get("mean_acceptance_length"))
            if kept is not None:
                measures.setdefault("vLLM acceptance length", {}).setdefault(name, []).append(kept)
    rows = []
    for measure, by_head in measures.items():
        if (row := seed_means(by_head)) is not None:
            rows.append({"measure": measure, **row, "holds": row["ours"] >= row["peer"] - row["spread"]})
    return rows


def per_category(results: dict, margin: float = BETTER) -> list[dict]:
    """The issue's "better" test, per question set and category: ours' mean replayed chain-3 tau over
    the seeds against the peer's mean, and whether ours is ahead by at least `margin`.
    {questions, category, seeds, ours, peer, ahead}."""
    taus: dict[tuple[str, str], dict[str, list[float]]] = {}
    for run_ in results["runs"].values():
        for qset, heads in run_["replay"].items():
            for name, report in heads.items():
                for category, row in (report.get("per_category") or {}).items():
                    taus.setdefault((qset, category), {}).setdefault(name, []).append(row["chain_3_tau"])
    rows = []
    for (qset, category), by_head in taus.items():
        if (row := seed_means(by_head)) is not None:
            row.pop("spread")
            rows.append(
                {"questions": qset, "category": category, **row, "ahead": row["ours"] >= (1 + margin) * row["peer"]}
            )
    return rows


def kept_part(row: dict) -> str:
    """' (x.xx kept)': vLLM's acceptance over what its answers kept, where compare.py gave it."""
    kept = row["vllm_acceptance"].get("kept_acceptance_length")
    return "" if kept is None else f" ({kept:.2f} kept)"


def write_report(results: dict, out: Path) -> None:
    """OUT/peer.json, OUT/peer.md (chain tau per K, per head and seed) and OUT/peer.png."""
    write_json(out / "peer.json", results)
    lines = []
    for seed, run_ in results["runs"].items():
        for qset, heads in run_["replay"].items():
            for name, report in heads.items():
                chain = report["chain_tau"]
                lines.append(
                    f"| {qset} | {seed} | {name} | "
                    + " | ".join(f"{chain[k]:.3f}" for k in sorted(chain, key=int))
                    + f" | {report['best_tree_tau']['5']:.3f} | {report['best_tree_tau']['16']:.3f} |"
                )
    ks = "| ".join(f"K={k} " for k in range(1, 9))
    header = f"| questions | seed | head | {ks}| best 5-node | best 16-node |\n|" + "---|" * 13
    body = f"{header}\n" + "\n".join(lines)
    vllm = [
        f"| {seed} | {name} | {row['vllm_acceptance']['mean_acceptance_length']:.2f}{kept_part(row)} | "
        + " ".join(f"{p:.2f}" for p in row["vllm_acceptance"]["per_position"])
        + f" | {row['infer_acceptance']['mean_acceptance_length']:.2f} | {row['identical'][0]}/{row['identical'][1]} |"
        for seed, run_ in results["runs"].items()
        for name, row in (run_.get("vllm") or {}).items()
        if row["vllm_acceptance"] and row["infer_acceptance"] and row["identical"]
    ]
    if vllm:
        body += (
            "\n\nvLLM's CPU build, the questions of `make engines`, 128 new tokens:\n\n"
            "| seed | head | vLLM acceptance length | per position | infer.py | = vLLM plain |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(vllm)
        )
    if rows := parity(results):
        body += (
            "\n\nParity (ours' mean over the seeds at least the peer's less the spread of ours):\n\n"
            "| measure | seeds | ours | peer | spread of ours | ours / peer | holds |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(
                f"| {r['measure']} | {r['seeds']} | {r['ours']:.3f} | {r['peer']:.3f} | {r['spread']:.3f} | "
                f"{r['ours'] / r['peer']:.3f} | {'yes' if r['holds'] else 'no'} |"
                for r in rows
            )
        )
    if rows := per_category(results):
        tally = {}
        for r in rows:
            tally.setdefault(r["questions"], []).append(r["ahead"])
        body += (
            "\n\nPer category, replayed chain 3 (ours' mean over the seeds against the peer's; "
            f"ahead: by {BETTER:.0%} or more):"
            "\n\n| questions | category | seeds | ours | peer | ours / peer | ahead |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(
                f"| {r['questions']} | {r['category']} | {r['seeds']} | {r['ours']:.3f} | {r['peer']:.3f} | "
                f"{r['ours'] / r['peer']:.3f} | {'yes' if r['ahead'] else 'no'} |"
                for r in rows
            )
            + "\n\n"
            + "\n".join(f"{q}: ahead by {BETTER:.0%} in {sum(a)} of {len(a)} categories" for q, a in tally.items())
        )
    if recipe := results.get("recipe"):
        extra = " ".join(recipe["overrides"])
        body = f"ours: the recipe `{recipe['name']}`, the matched settings and {extra}\n\n{body}"
    notes = "\n".join(f"- {u}" for u in results["unmatched"])
    write_text(out / "peer.md", f"{body}\n\nNot matched:\n{notes}\n")
    plot(results, out / "peer.png")
    plot_categories(results, out / "peer_categories.png")
    print((out / "peer.md").read_text())


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({q for r in results["runs"].values() for q in r["replay"]})
    if not sets:
        return
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for ax, qset in zip(axes[0], sets):
        for seed, run_ in results["runs"].items():
            for name, report in run_["replay"].get(qset, {}).items():
                ks = sorted(report["chain_tau"], key=int)
                style = "-" if name == "ours" else "--"
                ax.plot(
                    [int(k) for k in ks],
                    [report["chain_tau"][k] for k in ks],
                    style,
                    marker="o",
                    label=f"{name} seed {seed}",
                )
        ax.set(title=f"{qset}: {results['steps']} steps", xlabel="chain length K", ylabel="tau (replayed)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def plot_categories(results: dict, path: Path) -> None:
    """The per-category test as bars: each category's mean chain-3 tau over the seeds, ours beside the
    peer's, one panel per question set, the 5% line of "better" marked over the peer's bar."""
    rows = per_category(results)
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({r["questions"] for r in rows})
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, qset in zip(axes[0], sets):
        mine = [r for r in rows if r["questions"] == qset]
        x = range(len(mine))
        ours = f"ours ({results['recipe']['name']})" if results.get("recipe") else "ours"
        ax.bar([i - 0.2 for i in x], [r["ours"] for r in mine], 0.4, label=ours)
        ax.bar([i + 0.2 for i in x], [r["peer"] for r in mine], 0.4, label="the peer's")
        ax.scatter([i - 0.2 for i in x], [(1 + BETTER) * r["peer"] for r in mine], marker="_", s=400,
                   color="black", label=f"the peer's + {BETTER:.0%}")  # fmt: skip
        ax.set_xticks(list(x), [r["category"] for r in mine], rotation=30, ha="right")
        low = min(min(r["ours"], r["peer"]) for r in mine)
        ax.set(title=f"{qset}: chain-3 tau per category", ylabel="tau (replayed)", ylim=(max(0.0, low - 0.1), None))
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
