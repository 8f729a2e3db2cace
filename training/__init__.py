"""What every party needs to compute its part of a training step, shared by clients/ and strategies/.

- training.model: the base model with deterministic LoRA for a run config, on every party
- training.batches: tokenised samples, deterministic batch order, decoder inputs on the client
- training.selector: the seam where a visual-token selector (pruning) plugs in
- training.store: a party's private state on its own disk, snapshotted per round
"""
