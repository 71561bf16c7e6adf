# The two commands a newcomer needs on a fresh machine:
#   make demo   create the environment, install everything, run the main job end to end
#   make test   install what is missing, then lint and run the whole test suite
# Everything else here is a convenience for developers.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install whenever pyproject.toml or uv.lock changes; otherwise a second run skips straight to the work.
# The install is the lock, frozen: `uv sync --frozen` installs exactly uv.lock's versions (every extra, the
# project itself editable) and removes what the lock does not name; `uv lock` after editing pyproject.toml.
# --compile-bytecode: where PYTHONDONTWRITEBYTECODE is set (as here), nothing else writes .pyc files and
# every process would compile torch, Lightning and MLflow from source again (tens of seconds each).
STAMP := $(VENV)/.installed

.PHONY: demo test lint format kafka-install kafka-start kafka-stop clean

$(STAMP): pyproject.toml uv.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet uv
	@$(BIN)/uv lock --check --quiet || { echo "uv.lock does not match pyproject.toml: run $(BIN)/uv lock and commit uv.lock"; exit 1; }
	$(BIN)/uv sync --frozen --extra dev --quiet --compile-bytecode
	@touch $(STAMP)

kafka-install:
	scripts/kafka.sh install

demo: $(STAMP) kafka-install
	$(BIN)/txsentinel demo

# Two processes (pytest-xdist): the broker's tests in one, waiting on Kafka, the CPU-bound rest beside them;
# tests/conftest.py says which runs where.
test: $(STAMP) kafka-install lint
	$(BIN)/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

kafka-start: kafka-install
	scripts/kafka.sh start

kafka-stop:
	scripts/kafka.sh stop

clean:
	-scripts/kafka.sh stop
	rm -rf $(VENV) .kafka runs mlflow.db mlruns .pytest_cache .ruff_cache
