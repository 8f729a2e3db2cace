"""A tiny LLaVA and easy-VQA data for the attack tests, and a way to record what a client sends.

Victims are easy-VQA training rows, the attacker's auxiliary data test-split rows
(disjoint, as in a real run). The tiny model has random weights — a random vision
tower still carries its image (and each patch's position) into the features, which
is what the attacks invert.
"""

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from attacks.knowledge import AttackerKnowledge
from attacks.recording import Recorder, Recording
from attacks.truth import StaticTruth
from training.model import RANDOM_IMAGE_ID, RANDOM_PAD_ID, RANDOM_VOCAB_SIZE
from vlm.loading import build_random_model, clip_image_preprocessor
from vlm.lora import apply_lora
from vlm.mini.tokenizer import build_sample_tokenizer
from vlm.profiles import TINY
from vlm.segments import (
    merge_multimodal_inputs,
    project_visual_features,
    run_decoder_layers,
)
from vqa import VQASample, load_vqa
from wire import pack_rows

USL_CUTS = TINY.usl_cuts


@pytest.fixture(scope="session")
def victims() -> list[VQASample]:
    return list(load_vqa("easyvqa", "train", limit=48, seed=0))


@pytest.fixture(scope="session")
def aux() -> list[VQASample]:
    return list(load_vqa("easyvqa", "test", limit=300, seed=1))


def _tiny_model(seed: int = 0) -> torch.nn.Module:
    """The run's model as training.model builds it for the tiny profile: random base, fresh LoRA."""
    model = build_random_model(
        TINY, seed=seed, vocab_size=RANDOM_VOCAB_SIZE, image_token_id=RANDOM_IMAGE_ID, pad_token_id=RANDOM_PAD_ID
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return apply_lora(model, rank=TINY.lora_rank)


@pytest.fixture(scope="session")
def knowledge(victims, aux) -> AttackerKnowledge:
    tokenizer = build_sample_tokenizer([*victims, *aux])
    return AttackerKnowledge(
        model=_tiny_model(), tokenizer=tokenizer, preprocess_images=clip_image_preprocessor(TINY.image_size),
        cuts=USL_CUTS, instruction="",
    )


@pytest.fixture(scope="session")
def tiny_model():
    return _tiny_model


@torch.no_grad()
def _client_activation(
    knowledge: AttackerKnowledge, model: torch.nn.Module, batch: Sequence[VQASample],
    keep: Sequence[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """What a client's front sends at the first cut for a training batch (clients/split.py's path)."""
    features = knowledge.features(knowledge.pixel_values(batch))
    keep = keep or [torch.arange(features.shape[1])] * len(batch)
    visual = [project_visual_features(model, features[i, k].unsqueeze(0))[0] for i, k in enumerate(keep)]
    inputs = merge_multimodal_inputs(
        model, [knowledge.prompt_ids(s.question) for s in batch], visual, [knowledge.answer_ids(s.answer) for s in batch]
    )
    hidden = run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
                                knowledge.first_cut)
    rows, lengths = pack_rows(hidden, inputs.attention_mask)
    return {"rows": rows, "lengths": lengths}


@pytest.fixture
def client_activation():
    return _client_activation


Defense = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@pytest.fixture
def record_activations(tmp_path: Path, knowledge):
    """Record a client's first-cut activations for `samples` (batches of `batch_size`), optionally
    pruned/shuffled by `keep` and altered by `defense`; returns the recording and its truth."""

    def record(samples, *, batch_size=8, keep=None, defense: Defense | None = None, pruning="off",
               model=None, name="recording"):
        recorder = Recorder(tmp_path / name, header={"config": {"paradigm": "usl", "pruning.policy": pruning}})
        samples_by_seq, keep_by_seq = {}, {}
        for start in range(0, len(samples), batch_size):
            batch = samples[start : start + batch_size]
            batch_keep = None if keep is None else keep[start : start + batch_size]
            tensors = _client_activation(knowledge, model or knowledge.model, batch, batch_keep)
            if defense is not None:
                tensors = defense(tensors)
            entry = recorder.record(1, 1, "activation at CA", tensors)
            samples_by_seq[entry.seq] = list(batch)
            if batch_keep is not None:
                keep_by_seq[entry.seq] = list(batch_keep)
        return Recording.open(tmp_path / name), StaticTruth(samples_by_seq, keep_by_seq)

    return record
