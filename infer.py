"""Speculative decoding with a trained draft head: a demo answer, or the benchmark (conf/infer.yaml).

    python infer.py head=runs/demo/head prompt="Why is the sky blue?"
    python infer.py head=DIR bench.questions=question.jsonl bench.output=OUT.jsonl bench.max_new_tokens=64
    python infer.py head=DIR tree=auto        # calibrate the tree for this machine (kept in its cache)

The demo prints the answer with the drafted-and-accepted tokens marked and a stats line (tau,
tokens/s, speedup); the benchmark writes OUT.jsonl, OUT.summary.json and plots (docs/contracts.md).
"""

from pathlib import Path

from specheads.commands import infer, plain_values  # noqa: F401  (plain_values: infer.py's argument rewriting)

CONF_DIR = Path(__file__).resolve().parent / "conf"


def main() -> None:
    infer(CONF_DIR)


if __name__ == "__main__":
    main()
