"""Flower ClientApps: one role per paradigm, the client-side model and its private state."""
