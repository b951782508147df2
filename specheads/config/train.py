"""The schema of train.py (conf/config.yaml) and its groups head, data and deepspeed."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .model import ModelConfig


@dataclass
class HeadConfig:
    """One draft head. Family-specific fields are ignored by the other families (FAMILY_FIELDS says
    which family reads which). The head itself holds a specheads.heads.spec.HeadSpec: these fields
    with the target-dependent ones resolved.

    These defaults are the only ones: conf/head/<family>.yaml selects a family and sets nothing
    else, so the Python API and the command line train the same head (tests/config checks it)."""

    family: str = "eagle3"  # the head family, as conf/head/ names them (`head=NAME` picks one)
    # Hidden-state layer ids in our convention: the residual stream entering decoder layer k
    # (k = num_layers means after the last layer, before the final norm). None = family default.
    layer_ids: list[int] | None = None
    # medusa: heads, one per drafted depth
    num_heads: int = 4
    num_layers: int = 1  # medusa: residual blocks in each head
    shared_lm_head: bool = False  # medusa: the heads read the target's LM head instead of one each
    medusa_decay: float = 0.8  # medusa: head k's loss is weighted decay^k
    # eagle / eagle3: decoder layers of the draft model
    num_decoder_layers: int = 1
    intermediate_size: int | None = None  # MLP width of the draft layer; None = the target's
    fc_bias: bool = False  # a bias in the layer that projects the target's states into the draft
    # eagle: weight of the loss on the predicted next feature
    feature_loss_weight: float = 1.0
    token_loss_weight: float = 0.1  # eagle: weight of the next-token loss
    noise: str = "uniform"  # eagle: noise on the input features in training: uniform | gaussian | none
    noise_std: float = 0.2  # eagle: the noise's width (uniform) or standard deviation (gaussian)
    # eagle3, peagle (early_exit with draft_vocab): the draft vocabulary's size, the most frequent
    # tokens of the training answers
    draft_vocab_size: int = 8192
    ttt_steps: int = 7  # eagle3: draft steps unrolled in training on the head's own outputs (training-time test)
    ttt_decay: float = 0.8  # eagle3: unrolled step j's loss is weighted decay^j
    # eagle3: the positions the loss counts: in_vocab drops those whose target top token lies outside
    # the draft vocabulary (the draft can never propose it); all counts every answer position against
    # the target's distribution renormalized over the draft vocabulary (speculators' trainer)
    loss_positions: str = "in_vocab"
    # eagle3: keep the draft LM head at the target's rows for the draft vocabulary (speculators'
    # trainer); false trains it from them
    freeze_lm_head: bool = False
    # eagle3, peagle: the per-position loss between the target's and the draft's distributions over
    # the draft vocabulary (heads/objectives.py): kl (soft cross-entropy), or the acceptance rate's
    # own losses that speculators' trainer offers: tv, nla (-log acceptance), lk_hybrid (KL while
    # the draft is far off, TV as it gets close)
    loss_fn: str = "kl"
    lk_eta: float = 3.0  # lk_hybrid: KL's weight is exp(-lk_eta * acceptance)
    # eagle3, peagle: the variants of vLLM's speculators format (its trainer turns all three on by
    # default; false is the EAGLE-3 paper's draft): an RMSNorm over the fused target states before fc
    norm_before_fc: bool = False
    norm_before_residual: bool = False  # eagle3, peagle: layer 0's residual is the normed fused state
    norm_output: bool = False  # eagle3, peagle: each draft step feeds back its final-normed state (Eagle 3.1)
    # peagle (also reads the eagle3 fields above but the training-time test's): one draft forward
    # fills `parallel_depths` positions, the later ones from a mask token and a learned feature
    parallel_depths: int = 4
    # training packs depth d of a random max(rate^d, min_rate) share of the positions into the
    # forward of depth 0 (COD sampling): ~2.5x the rows of one depth for 4 depths at 0.7 / 0.2
    depth_keep_rate: float = 0.7
    depth_min_rate: float = 0.2  # the least share of positions packed for any depth (COD sampling)
    # train the head's own copy of the token embedding (the P-EAGLE paper's choice; the export then
    # carries embed_tokens), else the target's embedding is read frozen
    train_embeddings: bool = False
    # the token whose embedding fills the later positions; None = heads/mask_token.py's rule
    mask_token_id: int | None = None
    # dflash (also reads intermediate_size and mask_token_id above): a non-causal draft decoder filling
    # a block of [next token, MASK x (block_size - 1)] in one forward, the target's features injected
    # into every layer's keys and values

    # dflash: the block's slots (training blocks have block_size slots; a draft forward always runs
    # the whole block and drafts up to block_size - 1 tokens, dspark with sample_from_anchor block_size)
    block_size: int = 8
    dflash_layers: int = 2  # its decoder layers (also how many target layers it reads by default)
    # the loss weight of the draft at depth d (DFlash's slot d): exp(-(d - 1) / gamma) (the DFlash
    # paper: 4 for blocks of 8)
    dflash_gamma: float = 4.0
    # blocks per training sequence, at random anchors redrawn every step (fewer where fewer fit)
    anchors_per_sequence: int = 64
    # dspark (DSpark, arXiv 2607.05147; also reads the dflash fields above): DFlash's block with a
    # Markov head, a low-rank bias on each slot's logits from the token drafted before it, and a
    # confidence head that stops a block's drafting early

    # dspark: slot 0, which holds the bonus token, drafts the token after it, so a block drafts
    # block_size tokens (speculators' and DeepSpec's default); false drafts from slot 1 on, as DFlash
    sample_from_anchor: bool = True
    # the Markov bias's rank r: bias = markov_w2(markov_w1[previous token]), an r-wide embedding of
    # every token and a map from it to the vocabulary's logits (speculators' names)
    markov_rank: int = 256
    # vanilla = the bias of the previous token alone; gated = its embedding scaled by a sigmoid gate
    # over the slot's state and that embedding (speculators' stateless variants)
    markov_head_type: str = "vanilla"
    # a linear head on each slot's state predicting its acceptance rate, 1 - TV(target, draft)
    # (speculators' target); the block's cumulative acceptance is the product along its chain
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head also reads the previous token's Markov embedding
    confidence_head_alpha: float = 1.0  # the weight of the confidence head's binary cross-entropy in the loss
    # drafting stops at the first depth where the product of the predicted acceptance rates, along
    # the block's top-1 chain, is below this (0: never; a tree is cut at that depth)
    confidence_threshold: float = 0.0
    # dflash2 (also reads the dflash fields above): DFlash's block with a dynamic grouped convolution
    # before and after each attention and MLP sublayer, over the block's slots only, and a low-rank
    # selector reranking the LM head's top-k candidates of each slot (vLLM's qwen3_dflash2.py)

    # dflash2: the convolution's taps: slot i mixes slots i, i-1, ..., i-k+1 of its own block
    # (backward only, never across blocks), speculators' and vLLM's conv_kernel_size
    conv_kernel_size: int = 2
    # hidden channels per group sharing one dynamic kernel weight per tap (must divide the hidden
    # size; the groups are hidden_size / conv_group_size), vLLM's conv_group_size
    conv_group_size: int = 16
    # the candidate selector's rank r: a candidate c after token p at a slot of state h scores
    # logit(c) + sum_r predecessor[p, r] * (W h)[r] * successor[c, r], vLLM's selector_rank
    selector_rank: int = 256
    # the LM head's candidates per slot that the selector reranks (the draft's support;
    # a tree's branches at a node), vLLM's selector_top_k
    selector_top_k: int = 16
    # the weight of the selector's cross-entropy over each slot's top-k candidates (where
    # the data's token is among them) added to DFlash's loss
    selector_loss_weight: float = 1.0
    # hydra (also reads num_heads, num_layers, shared_lm_head and medusa_decay above)

    # Hydra++ teacher distillation: soft CE against the target's next-token distribution
    hydra_teacher_loss: bool = False
    # Hydra++ prefix layer: one causal decoder layer over the target's final states feeds the heads
    hydra_prefix_layer: bool = False
    # medusa2 (also reads the medusa fields above): a peft LoRA on the target trains with the heads

    lora_r: int = 16  # medusa2: the LoRA's rank
    lora_alpha: int = 32  # the LoRA's scale numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA's input
    # the target's linear layers that get a LoRA
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    heads_only_steps: int = 20  # stage 1: the heads alone on the unchanged target; then heads + LoRA
    # lambda: weight of the adapted target's own loss; 10x the heads' loss, as the Medusa recipe's
    # heads coefficient of 0.1 has it (BENCHMARKS.md: lambda = 1 let the target drift into repetition)
    lm_loss_weight: float = 10.0
    # the adapted target's own loss: kl = KL(original target || adapted target), the original being
    # the target with its LoRA switched off (self-distillation: the adapted target is held to the
    # original's answers); ce = cross-entropy on the data's assistant tokens
    lm_loss: str = "kl"
    # the LoRA's peak learning rate, a quarter of the heads' default train.lr (the recipe's
    # differential rate); null = train.lr (the heads')
    lora_lr: float | None = 5e-4
    lm_loss_warmup_steps: int = 20  # lambda ramps linearly from 0 over the first joint steps
    merge_lora: bool = False  # also write the target with the LoRA folded in (OUTPUT_DIR/merged)
    # early_exit (Kangaroo; also reads intermediate_size above): the draft runs the target's first
    # exit_layer decoder layers (on the target's own KV cache) and a trained adapter layer on their
    # output, read by the target's LM head; None = a quarter of the target's layers (at least 1)
    exit_layer: int | None = None
    # early_exit: the adapter layer also has an MLP (intermediate_size wide); false = Kangaroo's
    # adapter, attention and two norms only
    adapter_mlp: bool = False
    # early_exit: draft over the draft_vocab_size most frequent answer tokens of the training data
    # only (EAGLE-3's reduced vocabulary, chosen the same way), reading just those rows of the
    # target's LM head: on a small target the full LM head is much of a drafted level's cost. The
    # loss stays the full distribution's; false = every token (Kangaroo)
    draft_vocab: bool = False


# The HeadConfig fields each family reads; a head's config.json holds these and COMMON_HEAD_FIELDS
# only (an EAGLE-3 head has no LoRA rank). Hydra and Medusa-2 extend Medusa, DSpark and DFlash2
# extend DFlash.
COMMON_HEAD_FIELDS = ("family", "layer_ids", "draft_vocab_size", "eval_depth")
_MEDUSA = ("num_heads", "num_layers", "shared_lm_head", "medusa_decay")
_EAGLE_LAYER = ("num_decoder_layers", "intermediate_size", "fc_bias")
_EAGLE3_NORMS = ("norm_before_fc", "norm_before_residual", "norm_output")
_DFLASH = ("intermediate_size", "block_size", "dflash_layers", "dflash_gamma", "anchors_per_sequence", "mask_token_id")
FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    "medusa": _MEDUSA,
    "hydra": (*_MEDUSA, "hydra_teacher_loss", "hydra_prefix_layer", "intermediate_size"),
    "medusa2": (
        *_MEDUSA,
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "heads_only_steps",
        "lm_loss_weight",
        "lm_loss",
        "lora_lr",
        "lm_loss_warmup_steps",
        "merge_lora",
    ),
    "eagle": (*_EAGLE_LAYER, "feature_loss_weight", "token_loss_weight", "noise", "noise_std"),
    "eagle3": (
        *_EAGLE_LAYER,
        *_EAGLE3_NORMS,
        "ttt_steps",
        "ttt_decay",
        "loss_positions",
        "freeze_lm_head",
        "loss_fn",
        "lk_eta",
    ),
    "peagle": (
        *_EAGLE_LAYER,
        *_EAGLE3_NORMS,
        "freeze_lm_head",  # its LM head is EAGLE-3's, frozen alike: recorded so a reader knows
        "parallel_depths",
        "depth_keep_rate",
        "depth_min_rate",
        "train_embeddings",
        "mask_token_id",
        "loss_fn",
        "lk_eta",
    ),
    "dflash": _DFLASH,
    "dspark": (
        *_DFLASH,
        "sample_from_anchor",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "confidence_head_alpha",
        "confidence_threshold",
    ),
    "dflash2": (
        *_DFLASH,
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "selector_loss_weight",
    ),
    "early_exit": ("exit_layer", "adapter_mlp", "intermediate_size", "draft_vocab"),
}


def family_fields(family: str) -> tuple[str, ...]:
    """The head fields a head of `family` is made of (all of them for an unknown family)."""
    own = FAMILY_FIELDS.get(family)
    if own is None:
        return COMMON_HEAD_FIELDS + tuple(f.name for f in fields(HeadConfig))
    return COMMON_HEAD_FIELDS + own


@dataclass
class DataConfig:
    """The conversations the head trains on: their sources, filters and split."""

    name: str = "builtin"  # a label for the data
    # A local json/jsonl/parquet file, a local `datasets` directory, a Hub id, or "builtin"
    # (conversations the target writes for itself on first use, then cached).
    path: str = "builtin"
    # More sources mixed into `path` (files, distill.py outputs, Hub ids; not "builtin"), e.g. the
    # self-distilled conversations of a GPU run next to the diverse ones distill.py made here.
    mix: list[str] = field(default_factory=list)
    # at most this many conversations from each source (a seeded random subset); null = all
    max_per_source: int | None = None
    # a distill.py output that is still being written: train on its completed shards
    partial_distill: bool = False
    format: str = "auto"  # auto | sharegpt | openai
    split: str = "train"  # the split of a Hub dataset
    max_length: int = 512  # tokens per conversation (longer ones are cut)
    # pack the training conversations into rows of up to max_length tokens (first-fit decreasing),
    # each conversation kept apart in the target's forward and in the head's attention, positions and
    # targets, so no compute goes to padding; train.batch_size then counts packed rows. The
    # evaluation split stays one conversation per row (its numbers compare with unpacked runs)
    pack: bool = False
    eval_fraction: float = 0.05  # the share held out as the evaluation split
    max_examples: int | None = None  # at most this many conversations in all; null = all
    shuffle_seed: int = 0  # the seed of the shuffle and of the train/eval split
    # drop a conversation whose answers repeat more than this share of their 4-grams (a greedy
    # answer looping on itself, specheads.data.repeats); null = keep every row. With max_examples
    # the rows kept count, so a filtered run reads as many conversations as an unfiltered one.
    max_repeat_rate: float | None = None
    # Evaluation prompt files/globs (FastChat question.jsonl, ...) whose overlapping examples are
    # dropped, besides the shipped dev prompts (always kept out).
    decontaminate: list[str] = field(default_factory=list)
    ngram: int = 13  # a conversation sharing an n-gram this long with an evaluation prompt is dropped
    # builtin data: how many conversations the target writes (256 with answers of up to 80 tokens
    # build in about 4.5 minutes on a 2-core CPU with SmolLM2-135M)
    builtin_examples: int = 256
    builtin_answer_tokens: int = 80  # builtin data: the longest answer, in tokens
    builtin_batch_size: int = 64  # builtin data: prompts answered together
    # builtin data: conversation turns (> 1: the target also writes follow-up user turns)
    builtin_turns: int = 1
    builtin_seed: int = 0  # builtin data: the seed of its build
    # offline features: a cache directory written by distill.py, or "auto" (one target pass over
    # the data caches the states under the cache root; every epoch after it skips the target)
    features: str | None = None


@dataclass
class OnPolicyConfig:
    """On-policy distillation, a training stage for EAGLE-3 heads (Draft-OPD, Lei et al. 2026,
    arXiv 2605.29343; specheads/train/on_policy.py): our speculative loop rolls out training prompts
    with the current head and the frozen target, the head's drafting is replayed from each position
    where verification rejected its draft, and the frozen target's distribution supervises the head
    at every state its own drafts led to. Off by default: a run without it trains as before."""

    enabled: bool = False  # turn the stage on (head=eagle3)
    # the share of each optimizer step's loss that is on-policy: (1 - mix) x the supervised loss +
    # mix x the on-policy loss; 1 = on-policy only
    mix: float = 0.5
    # optimizer steps between rollout refreshes with the current head (the first step of a run, or
    # of a resumed one, rolls out); the replayed rows are kept in memory in between
    refresh_every: int = 25
    rollouts: int = 16  # training prompts rolled out at each refresh, all ranks together
    max_new_tokens: int = 128  # tokens each rollout generates (fewer when it ends with EOS)
    # the rollouts' sampling temperature: 0 = greedy, else lossless rejection sampling of the
    # target's tokens (the head's drafts are its top-1 chain either way, as it drafts at inference)
    temperature: float = 0.0
    # tokens the head drafts over its own proposals from each rejection position (the replayed
    # states the loss reads); null = head.ttt_steps. The rollouts' draft chain is head.ttt_steps long
    draft_steps: int | None = None


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. These are small-run defaults; the embedded default run
    (`python train.py`: SmolLM2-135M + EAGLE-3) takes its steps from conf/recipe/, and cluster
    runs set max_steps (or epochs), batch_size and grad_accum for their data."""

    max_steps: int = 60  # optimizer steps
    # a wall-clock budget: training stops (final evaluation, checkpoint and head as at max_steps)
    # after this many minutes of steps, loading not counted, and the cosine schedule is retargeted
    # to the step the budget is projected to reach; a resumed run gets a fresh budget. null = none
    max_minutes: float | None = None
    # when set, the number of steps comes from epochs over the training split (max_steps ignored)
    epochs: float | None = None
    batch_size: int = 4  # rows per rank per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 2e-3  # peak learning rate (AdamW), reached after warmup_steps
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 6  # linear warm-up of the learning rate
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    grad_clip: float = 0.5  # the gradient's largest norm
    # mixed precision for a float32 head: the online target forward and the head's forward and
    # backward run their matmuls in bfloat16 (or float16) under torch.autocast; weights, optimizer
    # state and losses stay float32, and a feature cache is still written in float32. On CPUs with
    # AVX512-BF16 or AMX this is the fast path (BENCHMARKS.md "Training at the data's scale");
    # without them bf16 is emulated and slower than float32 (the trainer says so); null = float32.
    autocast: str | None = None
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's betas
    # sort rows by length inside windows of batches (less padding, order still random)
    group_by_length: bool = True
    eval_every: int = 200  # 0 = only at the end (there is always a final evaluation)
    # per rank, each of train.batch_size rows: the held-out sample grows with the batch size, so compare
    # the eval metrics of runs of other batch sizes with null (the whole eval split)
    eval_batches: int | None = 4
    save_every: int = 50  # 0 = only at the end (there is always a final checkpoint)
    log_every: int = 5  # steps between metrics lines (DIR/metrics.jsonl and the trackers)
    keep_checkpoints: int = 2  # 0 = keep all
    # also write the head of every checkpoint as OUTPUT_DIR/heads/step-N (config.json + safetensors,
    # kept whatever keep_checkpoints prunes): what `infer.py bench.mode=replay` compares checkpoints on
    save_heads: bool = False
    # a head directory to start from instead of fresh weights (a published or earlier head continued
    # on new data, with a fresh optimizer and schedule); its family, target and shapes must match
    # this run's head fields. A run that resumes from its own checkpoint ignores it.
    init_from: str | None = None
    # on-policy distillation from rollouts of the head itself (OnPolicyConfig); off by default
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)


@dataclass
class WandbConfig:
    """Weights & Biases logging (offline by default: nothing leaves the machine)."""

    mode: str = "offline"  # disabled | offline | online
    project: str = "specheads"  # the wandb project
    entity: str | None = None  # the wandb team or user; null = your default
    name: str | None = None  # the run's name; null = wandb's


@dataclass
class TrackerConfig:
    """The experiment trackers that get the metrics and the run config besides DIR/metrics.jsonl:
    `tracker=NAME` or `tracker=[NAME,...]` (conf/tracker/: wandb, tensorboard, mlflow, none) switches
    them on; each writes under output_dir unless told otherwise, and a resumed run continues its run."""

    # W&B, set up by wandb.* (wandb.mode=disabled also turns it off); null = on unless another
    # tracker is chosen, so that the Python API and `python train.py` both default to it
    wandb: bool | None = None
    tensorboard: bool = False  # TensorBoard event files in OUTPUT_DIR/tensorboard
    mlflow: bool = False  # an MLflow run, in the store mlflow_uri names
    # the MLflow tracking URI; null = a local file store in OUTPUT_DIR/mlruns (`mlflow ui
    # --backend-store-uri OUTPUT_DIR/mlruns` reads it); or a server, sqlite:///FILE, ...
    mlflow_uri: str | None = None
    mlflow_experiment: str = "specheads"  # the MLflow experiment the run is filed under
    mlflow_run_name: str | None = None  # the MLflow run's name; null = MLflow's

    def chosen(self) -> list[str]:
        """The trackers this config turns on, wandb's mode aside."""
        on = [name for name in ("tensorboard", "mlflow") if getattr(self, name)]
        wandb = self.wandb if self.wandb is not None else not on
        return ["wandb"] * wandb + on


@dataclass
class DeepSpeedConfig:
    """DeepSpeed for the head (the frozen target is never wrapped, unless shard_target)."""

    zero_stage: int = 2  # ZeRO stage of the head's optimizer state, gradients (2) and parameters (3)
    offload_optimizer: bool = False  # keep the optimizer state in CPU memory
    offload_param: bool = False  # keep the head's parameters in CPU memory (ZeRO-3)
    # the frozen target partitioned over the ranks (ZeRO-3 inference: each rank holds 1/world of it,
    # a layer gathered for its forward); null = as the memory plan says: sharded when the whole
    # target does not fit a rank but its shard does (GPU runs); true / false
    shard_target: bool | None = None
    # Extra keys merged verbatim into the DeepSpeed JSON config.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlanConfig:
    """The GPUs train.py's memory plan (specheads.train.plan) fits the run into: declared here, or
    else the visible ones (in a launched run, one per rank)."""

    gpus: int | None = None  # ranks, one GPU each
    gpu_memory: str | None = None  # per GPU: "80GB" (10^9 bytes) or "80GiB" (2^30 bytes)
    # tokens an offline feature cache would hold (its disk size); None = data.max_examples x
    # data.max_length when max_examples is set, else an assumed 1M
    tokens: int | None = None
    # a GPU run whose plan does not fit is refused before anything is loaded; false: warn, go on
    check: bool = True
    # the GPU type the plan's time is estimated for (specheads.train.throughput.GPUS: a100, h100,
    # h200, b200, l40s, ...); null = the visible GPU's, else h100
    gpu: str | None = None


@dataclass
class BudgetConfig:
    """What a run on a real target needs before it starts (specheads.train.budget), and the data a
    recipe trains on, for the plan's time and disk (dry_run=true). conf/recipe/ sets the data
    fields; the defaults refuse only what could only make a useless head."""

    # a target of at least this many parameters is a real one: data.path=builtin (a few hundred
    # conversations the target writes on the fly) is refused for it, with the distill.py command
    # that makes its data, and so is a budget of less than min_epochs of that data
    real_target_parameters: float = 1e9
    # a real target's run that trains on less than this share of an epoch of its data is refused
    min_epochs: float = 0.5
    allow_toy: bool = False  # run such a run anyway (it says so on stderr)
    # the recipe's data: how many conversations (the plan's time and disk; null = unknown)
    conversations: int | None = None
    mean_tokens: int = 1024  # the tokens of a conversation on average (the plan's time and disk)
    # the commands that make the recipe's data (distill.py); a run refused for its data prints them
    make_data: list[str] = field(default_factory=list)


@dataclass
class TrainJobConfig:
    """train.py: a draft head trained on the frozen target's hidden states."""

    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # the trackers that get the metrics: `tracker=NAME` (wandb, tensorboard, mlflow or none) or `tracker=[NAME,...]`
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    # the run's directory: checkpoints, metrics, the head in OUTPUT_DIR/head (the same command resumes)
    output_dir: str = "runs/${model.name}-${head.family}"
    # dtype of the written head's weights: auto = the training dtype; bfloat16 / float16 halve it
    save_dtype: str = "auto"
    seed: int = 0  # seeds the head's initialisation, the training noise and (unless data_seed) the row order
    # seeds the order of the training rows (which rows each step reads); null = seed. Fixing it while
    # seed varies measures the spread of the initialisation alone, on the very same steps
    data_seed: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    debug: bool = False  # full tracebacks instead of one-line errors
    # print the per-rank memory plan for plan.gpus x plan.gpu_memory and exit, loading nothing
    dry_run: bool = False
    plan: PlanConfig = field(default_factory=PlanConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
