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

import hydra
from omegaconf import DictConfig

from specheads.cli import job, run_hydra_main
from specheads.config import register_configs, typed
from specheads.errors import one_line_errors

register_configs()


@hydra.main(config_path="conf", config_name="distill", version_base=None)
@job
@one_line_errors
def main(cfg: DictConfig) -> None:
    from specheads.distill.run import distill

    out = distill(typed(cfg))
    if out is not None:  # rank 0 of a launched group, or the only process
        print(out, flush=True)


if __name__ == "__main__":
    run_hydra_main(main)
