"""The model: LLaVA-1.5 at three sizes on one code path.

- vlm.profiles: architecture numbers and default cuts per size (llava-1.5-7b, mini, tiny)
- vlm.cuts: which decoder layers each party (client/server, head/body/tail) owns
- vlm.loading: a ModelBundle for a profile (real weights, random weights, or meta for counting)
- vlm.segments: vision features, projector, merge, decoder segments, loss, greedy generation
- vlm.lora: LoRA on the decoder projections and its per-owner state
"""
