"""One thin Flower App folder per simulation (`sims/<name>/pyproject.toml`, whose run-config table
`sims.apps` writes from the schema and the app's overrides), the launcher (`sims.launch`), the
in-process runner and sweeps (`sims.sweep`, shipped files in `sims/sweeps/`); the run-config schema
they read is `config/`, and what they write is read by `analysis/`."""
