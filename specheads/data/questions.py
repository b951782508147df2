"""The project's own development prompt set (FastChat question.jsonl format), shipped with the package.

It is what `make demo` benchmarks (`bench.questions=specheads/data/dev_questions.jsonl`), so it is
never trained on: decontamination always includes it.
"""

from pathlib import Path

DEV_QUESTIONS = Path(__file__).with_name("dev_questions.jsonl")
