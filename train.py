"""Train a speculative-decoding draft head on a frozen target (configs: conf/config.yaml).

    python train.py                                        # SmolLM2-135M + EAGLE-3, self-made data, CPU
    python train.py model=llama-3.1-8b head=eagle data.path=FILE.jsonl output_dir=DIR
    deepspeed --num_gpus 8 train.py model=llama-70b head=eagle3 deepspeed=zero3
    torchrun --nproc_per_node 2 train.py model=tiny-random

Writes the head to OUTPUT_DIR/head/ and prints that path as the last line. Running the same
command again with the same output_dir resumes from the newest complete checkpoint.
"""

from pathlib import Path

from specheads.commands import train

CONF_DIR = Path(__file__).resolve().parent / "conf"


def main() -> None:
    train(CONF_DIR)


if __name__ == "__main__":
    main()
