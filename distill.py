"""Self-distillation: the frozen target writes (or reads) prompts and answers them (conf/distill.yaml).

    python distill.py                                   # SmolLM2-135M writes 256 prompts and answers them
    python distill.py model=tiny-random distill.num_prompts=8 distill.output=DIR
    python distill.py distill.prompts=sharegpt.json distill.num_prompts=20000 distill.output=DIR
    python distill.py distill.turns=2 distill.decontaminate=[eval/question.jsonl]
    torchrun --nproc_per_node 8 distill.py distill.output=DIR distill.features.enabled=true
                                                        # 8 ranks cache the features of a finished DIR

Writes DIR/shards/*.jsonl (OpenAI "messages"), DIR/manifest.json and DIR/metadata.json, and
prints DIR on its last line. Running the same command again finishes an interrupted run.
Train on it with `python train.py data.path=DIR`.
"""

from pathlib import Path

from specheads.commands import distill

CONF_DIR = Path(__file__).resolve().parent / "conf"


def main() -> None:
    distill(CONF_DIR)


if __name__ == "__main__":
    main()
