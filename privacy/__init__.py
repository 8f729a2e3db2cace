"""Defenses: noise, sparsification, shuffling, PriPert, positional-embedding removal, DP accounting."""
