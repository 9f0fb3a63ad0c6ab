# `make demo` and `make test` each set up .venv first (idempotent: a second setup installs nothing).
PY := .venv/bin/python
MRL := .venv/bin/mrl
DEMO := runs/tiny-deepseek-v3

.PHONY: setup demo test test-fast clean

setup:
	bash scripts/setup_env.sh

# The main job available today: a tiny DeepSeek-V3 (MLA + MoE) checked HF ⇄ Megatron in TP2×EP2.
demo: setup
	$(MRL) tiny-model --arch deepseek_v3 --out $(DEMO) --force
	$(MRL) verify --hf $(DEMO) --tp 2 --ep 2

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest tests/unit

clean:
	rm -rf runs .pytest_cache
