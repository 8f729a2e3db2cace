# Each target sets up .venv on first use (scripts/setup.sh), so a fresh machine needs only `make`.
.PHONY: setup test run mini-targets attack-results

setup:
	@bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest -q

run: setup
	.venv/bin/qpriv-mini build
	.venv/bin/python -m sims.launch sims/usl_easyvqa

mini-targets: setup
	.venv/bin/python benchmarks/mini_targets.py

attack-results: setup
	.venv/bin/qpriv-mini build
	.venv/bin/python benchmarks/attack_results.py
