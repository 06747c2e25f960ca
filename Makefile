# tq_pipelines: `make dev` runs the whole system, `make test` runs the tests. Both set up .venv
# from constraints.txt first. `make help` lists every target.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TEST_URL ?= postgresql://postgres@127.0.0.1:5432/postgres

.DEFAULT_GOAL := help
.PHONY: help install dev test lint format typecheck check bench schema db-stop clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit("Python 3.11+ is needed, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,k8s,bench]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv with the pinned dependencies

dev: $(STAMP) ## database up and migrated, Dagster UI and daemon on http://localhost:3000 (Ctrl-C stops all)
	$(BIN)/tq dev

test: $(STAMP) ## run the tests (TQ_TEST_DATABASE_URL, else an embedded PostgreSQL)
	$(BIN)/pytest

lint: $(STAMP) ## ruff: lint and format check
	$(BIN)/ruff check tq_pipelines tq_pipelines_demo tests bench
	$(BIN)/ruff format --check tq_pipelines tq_pipelines_demo tests bench

format: $(STAMP) ## ruff: fix what can be fixed and format
	$(BIN)/ruff check --fix tq_pipelines tq_pipelines_demo tests bench
	$(BIN)/ruff format tq_pipelines tq_pipelines_demo tests bench

typecheck: $(STAMP) ## mypy on the package
	$(BIN)/mypy

check: lint typecheck ## lint and typecheck

bench: $(STAMP) ## queue throughput against pgbench (needs a server: TQ_BENCH_URL, default 127.0.0.1:5432)
	$(BIN)/python bench/queue_throughput.py --url $${TQ_BENCH_URL:-$(TEST_URL)}

schema: $(STAMP) ## regenerate sql/schema.sql from the migrations (needs a server: TQ_BENCH_URL)
	$(BIN)/python -m tq_pipelines.db.schema $${TQ_BENCH_URL:-$(TEST_URL)} -o sql/schema.sql

db-stop: $(STAMP) ## stop the embedded PostgreSQL of `make dev`
	$(BIN)/tq db stop

clean: ## remove .venv and caches (not the data in .tq/)
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
