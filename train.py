"""Train a speculative-decoding draft head on a frozen target (configs: conf/config.yaml).

    python train.py                                        # SmolLM2-135M + EAGLE-3, self-made data, CPU
    python train.py model=llama-3.1-8b head=eagle data.path=FILE.jsonl output_dir=DIR
    deepspeed --num_gpus 8 train.py model=llama-70b head=eagle3 deepspeed=zero3
    torchrun --nproc_per_node 2 train.py model=tiny-random

Writes the head to OUTPUT_DIR/head/ and prints that path as the last line. Running the same
command again with the same output_dir resumes from the newest complete checkpoint.
"""

import hydra
from omegaconf import DictConfig

from specheads.cli import job, run_hydra_main
from specheads.config import register_configs, typed
from specheads.errors import one_line_errors

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base=None)
@job
@one_line_errors
def main(cfg: DictConfig) -> None:
    from specheads.train.run import train

    head_dir = train(typed(cfg))
    if head_dir is not None:  # rank 0
        print(head_dir, flush=True)


if __name__ == "__main__":
    run_hydra_main(main)
