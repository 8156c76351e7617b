# nmt-serve. `make serve` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
MODEL_REPOSITORY ?= models/en-fr/1
# torch 2.13.0 is the CPU build on this machine's disk; any other version pulls CUDA.
TORCH := torch==2.13.0

# Packages whose French catalogs join the system's in the shipped corpus (pinned: the corpus is deterministic).
CORPUS_PACKAGES := django==5.2.19 sphinx==9.0.4 wagtail==8.0.1 django-allauth==65.22.1 weblate==5.14.3 pretix==2026.8.0
BUILD := build
TRAIN_MINUTES ?= 66

LOADTEST_USERS ?= 8
LOADTEST_TIME ?= 180
IMAGE ?= nmt-serve:0.1.0

.PHONY: serve test model proto image loadtest clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# serving only: no torch
$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# everything the tests and the offline pipeline need
$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[export,loadtest,dev]'
	touch $@ $(VENV)/.serve

serve: $(VENV)/.serve
	$(BIN)/nmt serve --model-repository $(MODEL_REPOSITORY)

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

# regenerate service/proto/ from proto/ (tests/test_proto.py fails when it is stale)
proto: $(VENV)/.dev
	$(BIN)/python -m grpc_tools.protoc -Iservice/proto=proto --python_out=. --pyi_out=. --grpc_python_out=. proto/nmt/v1/translation.proto

# corpus -> tokenizers -> training -> release -> evaluation -> export + verification, end to end
# (about 80 minutes on 2 cores). Writes the shipped model: models/en-fr/checkpoint-1.pt and models/en-fr/1/.
model: $(VENV)/.dev
	$(BIN)/pip install -q --no-deps --target $(BUILD)/corpus-packages $(CORPUS_PACKAGES)
	$(BIN)/nmt corpus --catalogs /usr/share/locale $(BUILD)/corpus-packages --output $(BUILD)/corpus
	$(BIN)/nmt tokenizers $(BUILD)/corpus --output $(BUILD)/tokenizers
	$(BIN)/nmt train $(BUILD)/corpus --tokenizers $(BUILD)/tokenizers --output $(BUILD)/train --minutes $(TRAIN_MINUTES)
	$(BIN)/nmt release $(BUILD)/train/best.pt models/en-fr/checkpoint-1.pt --force
	$(BIN)/nmt evaluate models/en-fr/checkpoint-1.pt --corpus $(BUILD)/corpus --output $(BUILD)/eval
	$(BIN)/nmt export models/en-fr/checkpoint-1.pt --output $(MODEL_REPOSITORY) --quantize int8 \
		--test-split $(BUILD)/corpus/test.jsonl --quality $(BUILD)/eval/results.json --force

# Locust, headless, against a server it starts (reports under loadtest/results/locust/)
loadtest: $(VENV)/.dev
	$(BIN)/python loadtest/run_locust.py --model-repository $(MODEL_REPOSITORY) --users $(LOADTEST_USERS) --time $(LOADTEST_TIME)

# the serving image (no torch); needs a Docker engine (../shared/tools/container-engine/setup.sh here)
image:
	docker build -t $(IMAGE) -t nmt-serve:latest .

clean:
	rm -rf $(BUILD) .pytest_cache
