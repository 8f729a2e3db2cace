"""Run-config schema and one Flower App folder per simulation."""
