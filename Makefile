# Each target sets up .venv on first use (scripts/setup.sh), so a fresh machine needs only `make`.
.PHONY: setup test run mini-targets sweeps

setup:
	@bash scripts/setup.sh

# Four workers on CI's two cores: the three long files (`flwr run` and the deployment tests) spend
# most of their minutes waiting on Flower (heartbeats, cold starts, timeouts), and the fourth worker
# keeps the cores busy meanwhile. Whole files per worker, so module fixtures are built once and the
# `flwr run` tests (fixed ports) share one SuperLink; tests/conftest.py orders the files, long ones first.
test: setup
	.venv/bin/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder

# `build` installs the shipped weights (digest checked) in seconds; `build --from-scratch` rebuilds them (about an hour and a half on one core).
run: setup
	.venv/bin/qpriv-mini --profile mini-scenes build
	.venv/bin/python -m sims.launch sims/usl_scenes

mini-targets: setup
	.venv/bin/python benchmarks/mini_targets.py

# Every sweep behind a results/*.md (benchmarks/sweep_results.py's SWEEPS), archived as it goes, and the
# mini builds they run on. sims/sweeps/memorisation.toml feeds benchmarks/testbed_memorisation.py;
# smoke.toml is the tests'; pruning-mia.toml joins pruning-attacks' claims (its membership) and
# memorisation-audit.toml federated-privacy's report (the input-space audit where membership leaks).
SWEEPS = paradigms pruning-attacks defenses vision-edge federated-privacy dpmtv cross-device

sweeps: setup
	.venv/bin/qpriv-mini build
	.venv/bin/qpriv-mini --profile mini-scenes build
	.venv/bin/qpriv-mini --profile mini-interleaved build
	for sweep in pruning-mia memorisation-audit $(SWEEPS); do \
		.venv/bin/qpriv-sweep run sims/sweeps/$$sweep.toml --archive results/sweeps/$$sweep || exit 1; \
	done
	for sweep in $(SWEEPS); do .venv/bin/python benchmarks/sweep_results.py $$sweep || exit 1; done
