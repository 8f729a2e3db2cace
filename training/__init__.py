"""What every party needs to compute its part of a training step, shared by clients/ and strategies/.

- training.protocol: every message type, transfer kind and tensor both sides and the recorder name
- training.data: a run's data, built once (datasets, shards, tokenizer, stamp marks, public rows)
- training.model: the base model with deterministic LoRA for a run config; what each party materialises
- training.batches: tokenised samples, deterministic batch order, decoder inputs on the client
- training.selector: the seam where a visual-token selector (pruning) plugs in
- training.store: a party's private state on its own disk, snapshotted per round
"""
