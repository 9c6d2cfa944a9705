# colossal_lab: the two commands are `make book` (the main job) and `make test`.
# Both create .venv from requirements.txt first when it is missing or stale.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: book test test-gpu lint execute gpu-results gpu-results-2 wheelhouse clean

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

## book: build the HTML book from the committed (GPU-executed) notebook outputs
book: $(VENV)/.installed
	$(VENV)/bin/jupyter-book build --all -W .
	@echo "open _build/html/index.html"

## test: unit tests, every notebook executed on this machine (nbval), lint, book build,
## then the built book opened in headless Chromium (tests/test_book_browser.py).
## Unit tests and notebooks run on TEST_WORKERS processes (pytest-xdist; CI has 2 cores):
## a test file, or a notebook's cells, stay together on one worker (--dist loadfile);
## OMP_NUM_THREADS=1 keeps each notebook's kernel to one core of its own.
## `make test TEST_WORKERS=0` runs everything in one process, as before.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
test: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) -m "not browser" --durations=15 tests
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) --durations=12 --nbval-lax --nbval-current-env book/
	$(VENV)/bin/ruff check colossal_lab tests notes
	$(MAKE) book
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	  echo "$(PY) -m pytest -q -rfEs -m browser tests/test_book_browser.py"; \
	  $(PY) -m pytest -q -rfEs -m browser tests/test_book_browser.py; \
	else \
	  echo "browser test could not run: no Chromium (apt-get install chromium)"; \
	  case "$${CI:-}" in ""|0|false|False|FALSE|no) ;; *) exit 1 ;; esac; \
	fi

## test-gpu: the GPU-only tests (kernels compiled for the device, bf16 rules)
test-gpu:
	$(PYTHON) -m pytest -q -m gpu tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check colossal_lab tests notes

## execute: re-run every notebook in place (on a GPU node: fresh measurements)
execute:
	$(PYTHON) -m colossal_lab execute book/*.ipynb

## gpu-results: run every benchmark and save results/<gpu>/*.json
gpu-results:
	$(PYTHON) -m colossal_lab env --save
	$(PYTHON) -m colossal_lab bench baseline
	$(PYTHON) -m colossal_lab bench step_noise
	$(PYTHON) -m colossal_lab bench fused_norm
	$(PYTHON) -m colossal_lab bench fused_norm_step
	$(PYTHON) -m colossal_lab bench flash_attention
	$(PYTHON) -m colossal_lab bench flash_attention_step
	$(PYTHON) -m colossal_lab bench fused_qkv
	$(PYTHON) -m colossal_lab bench fused_qkv_step
	$(PYTHON) -m colossal_lab bench checkpointing --group sweep
	$(PYTHON) -m colossal_lab bench checkpointing --group 7b
	$(PYTHON) -m colossal_lab bench precision
	$(PYTHON) -m colossal_lab bench rope
	$(PYTHON) -m colossal_lab bench cross_entropy
	$(PYTHON) -m colossal_lab bench optimizer
	$(PYTHON) -m colossal_lab bench composed
	$(PYTHON) -m colossal_lab bench composed_curves
	$(PYTHON) -m colossal_lab bench waterfall
	$(PYTHON) -m colossal_lab bench grad_overlap
	$(PYTHON) -m colossal_lab bench pipeline_sim
	$(PYTHON) -m colossal_lab bench sequence_parallel_gemm
	$(PYTHON) -m colossal_lab bench profile_breakdown
	$(PYTHON) -m colossal_lab bench step_floor
	$(PYTHON) -m colossal_lab bench spot_check

## gpu-results-2: the multi-GPU benchmarks on a node with 2 GPUs (`make gpu-results-2`);
## results/<gpu>x2/*.json. One invocation per NCCL link setting (nvlink, host memory,
## sockets; NVLink multicast always off), each merged into its file by link (and preset)
TORCHRUN ?= torchrun --nproc-per-node 2
gpu-results-2:
	$(TORCHRUN) -m colossal_lab bench collectives --link nvlink
	$(TORCHRUN) -m colossal_lab bench collectives --link host
	$(TORCHRUN) -m colossal_lab bench collectives --link sockets
	$(TORCHRUN) -m colossal_lab bench grad_overlap_measured --link nvlink --presets llama-7b-8l
	$(TORCHRUN) -m colossal_lab bench grad_overlap_measured --link nvlink --presets 1b
	$(TORCHRUN) -m colossal_lab bench grad_overlap_measured --link host --presets llama-7b-8l
	$(TORCHRUN) -m colossal_lab bench grad_overlap_measured --link host --presets 1b
	$(TORCHRUN) -m colossal_lab bench grad_overlap_measured --link sockets --presets llama-7b-8l
	$(TORCHRUN) -m colossal_lab bench grad_overlap_measured --link sockets --presets 1b
	$(TORCHRUN) -m colossal_lab bench sequence_parallel_step
	$(TORCHRUN) -m colossal_lab bench pipeline_measured

## wheelhouse: download wheels for an offline GPU node (Python 3.12, x86-64)
wheelhouse: $(VENV)/.installed
	$(PY) -m colossal_lab wheelhouse --dest .whl --python 3.12

clean:
	rm -rf _build
