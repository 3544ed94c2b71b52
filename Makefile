# comlrl — make targets. `make` (or `make help`) lists them.
#   make install                        create .venv and install comlrl (editable) with dev + launcher extras
#   make train [ARGS="k=v ..."]         one run: python experiments/main.py $(ARGS)
#   make resume RUN=outputs/... [EPOCHS=N] [ARGS="k=v ..."]
#   make sweep | plot RUN=... | sync RUN=... | bench | bench-shape | test | clean | distclean

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Re-install only when the package metadata or the torch pin changes.
STAMP := $(VENV)/.comlrl-installed
TORCH_PIN := torch==2.13.0
PIP_ARGS ?=

RUN ?=
EPOCHS ?=
ARGS ?=
# Processes per run: NPROC>1 launches data-parallel ranks with torchrun (one node; gloo on CPU,
# nccl on GPUs). All ranks share one run dir through COMLRL_RUN_STAMP.
NPROC ?= 1

# One intra-op thread: at these model sizes more threads only add contention (override per call).
export OMP_NUM_THREADS ?= 1

TEST_ENV := OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline

ifeq ($(NPROC),1)
LAUNCH = $(PY)
else
LAUNCH = COMLRL_RUN_STAMP=$${COMLRL_RUN_STAMP:-$$(date +%Y-%m-%d_%H-%M-%S)_$$(od -An -N2 -tx1 /dev/urandom | tr -d ' \n')} \
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC)
endif

.PHONY: help install train resume sweep plot sync bench bench-shape test clean distclean

help: ## list the targets
	@echo "comlrl — cooperative multi-LLM RL (MAGRPO) experiments"
	@echo
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-zA-Z_-]*:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo "Variables: ARGS=\"k=v ...\" (Hydra overrides), RUN=<run dir>, EPOCHS=N (resume), NPROC=N (torchrun ranks)"
	@echo "Examples:  make train ARGS=\"trainer.num_train_epochs=4 logger=none\""
	@echo "           make resume RUN=outputs/default/2025-01-31_12-00-00_ab12 EPOCHS=4"

install: $(STAMP) ## create .venv and install comlrl -e '.[dev,launchers]' (idempotent)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt $(PIP_ARGS) "$(TORCH_PIN)" -e '.[dev,launchers]'
	@$(PY) -m comlrl.models.decode_kernels  # the decode kernel, compiled once per machine (else on first use)
	@touch $@

train: install ## one training run: python experiments/main.py $(ARGS)
	$(LAUNCH) experiments/main.py $(ARGS)

resume: install ## continue RUN=<run dir> in place [EPOCHS=N total] [ARGS=run-shape overrides]
	@test -n "$(RUN)" || { echo "usage: make resume RUN=outputs/<name>/<timestamp> [EPOCHS=N] [ARGS=\"k=v ...\"]" >&2; exit 2; }
	$(PY) experiments/resume.py --nproc $(NPROC) "$(RUN)" $(if $(EPOCHS),trainer.num_train_epochs=$(EPOCHS)) $(ARGS)

sweep: install ## example sweep: 2 jobs (num_generations=2,4) in parallel with joblib, 1 epoch
	$(PY) experiments/main.py -m experiment=smoke trainer.num_generations=2,4 \
		hydra/launcher=joblib hydra.launcher.n_jobs=2 $(ARGS)

plot: install ## reward and loss curves of RUN -> RUN/curves.png
	@test -n "$(RUN)" || { echo "usage: make plot RUN=outputs/<name>/<timestamp>" >&2; exit 2; }
	$(PY) -m comlrl.plot "$(RUN)"

sync: install ## upload RUN's W&B offline segments, oldest first (ARGS=--dry-run to list)
	@test -n "$(RUN)" || { echo "usage: make sync RUN=outputs/<name>/<timestamp>" >&2; exit 2; }
	$(PY) -m comlrl.wandb_offline "$(RUN)/wandb" --sync $(ARGS)

bench: install ## speed against CoMLRL 1.4.3; updates the README's Performance section
	$(PY) benchmarks/run.py --update-readme $(ARGS)

bench-shape: install ## tokens/s of sampling and update at a real model's shape (random init; ARGS="--shape qwen2.5-1.5b")
	$(PY) benchmarks/throughput.py $(ARGS)

test: install ## the test suite (CPU, offline; then the GPU tests where a CUDA device is present)
	$(TEST_ENV) $(PY) -m pytest -q $(ARGS)
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		echo "A CUDA device is present: running the GPU tests (pytest -m gpu)"; \
		$(TEST_ENV) $(PY) -m pytest -q -m gpu tests/test_gpu.py; fi

clean: ## remove run outputs and caches (keeps .venv and the model cache)
	rm -rf outputs/* multirun .pytest_cache
	find . -path ./$(VENV) -prune -o -path './benchmarks/.venv*' -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf
	@touch outputs/.gitkeep

distclean: clean ## clean, and remove .venv and the local model cache (.cache/)
	rm -rf $(VENV) .cache
