# Each target sets up .venv on first use (scripts/setup.sh), so a fresh machine needs only `make`.
.PHONY: setup test run mini-targets sweeps

setup:
	@bash scripts/setup.sh

# Two workers for CI's two cores; whole files per worker, so module fixtures are built once and
# the `flwr run` tests (fixed ports) share one SuperLink.
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile

# The scene testbed's weights ship with the code: `build` installs them (digest checked) in seconds.
run: setup
	.venv/bin/qpriv-mini --profile mini-scenes build
	.venv/bin/python -m sims.launch sims/usl_scenes

mini-targets: setup
	.venv/bin/python benchmarks/mini_targets.py

sweeps: setup
	.venv/bin/qpriv-mini build
	.venv/bin/qpriv-sweep run sims/sweeps/paradigms.toml --archive results/sweeps/paradigms
	.venv/bin/qpriv-sweep run sims/sweeps/pruning-attacks.toml --archive results/sweeps/pruning-attacks
	.venv/bin/qpriv-sweep run sims/sweeps/defenses.toml --archive results/sweeps/defenses
	.venv/bin/qpriv-sweep run sims/sweeps/federated-privacy.toml --archive results/sweeps/federated-privacy
	.venv/bin/python benchmarks/sweep_results.py paradigms
	.venv/bin/python benchmarks/sweep_results.py pruning-attacks
	.venv/bin/python benchmarks/sweep_results.py defenses
	.venv/bin/python benchmarks/sweep_results.py federated-privacy
