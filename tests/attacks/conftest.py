"""A tiny LLaVA and easy-VQA data for the attack tests, and a way to record what a client sends.

Victims are easy-VQA training rows, the attacker's auxiliary data test-split rows
(disjoint, as in a real run). The tiny model has random weights — a random vision
tower still carries its image (and each patch's position) into the features, which
is what the attacks invert. `defended_config` and `client_defense` give a run's config
with defenses at the cut and the client's application of them (privacy/), for the
adaptive attackers.
"""

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from attacks.knowledge import AttackerKnowledge, split_packed
from attacks.recording import Recorder, Recording
from attacks.truth import StaticTruth
from config import SimConfig, load_config
from privacy import ACTIVATION, Payload
from training.defenses import build_defenses
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
    keep: Sequence[torch.Tensor] | None = None, *, with_front: bool = False,
) -> dict[str, torch.Tensor]:
    """What a client's front sends at the first cut for a training batch (clients/split.py's path);
    `with_front`: also its packed input rows ("inputs") and the front as a function of them
    ("front"), what a defense that looks through the front needs (privacy.Payload)."""
    features = knowledge.features(knowledge.pixel_values(batch))
    keep = keep or [torch.arange(features.shape[1])] * len(batch)
    visual = [project_visual_features(model, features[i, k].unsqueeze(0))[0] for i, k in enumerate(keep)]
    inputs = merge_multimodal_inputs(
        model, [knowledge.prompt_ids(s.question) for s in batch], visual, [knowledge.answer_ids(s.answer) for s in batch]
    )
    hidden = run_decoder_layers(model, inputs.hidden_states, inputs.attention_mask, inputs.position_ids, 0,
                                knowledge.first_cut)
    rows, lengths = pack_rows(hidden, inputs.attention_mask)
    if not with_front:
        return {"rows": rows, "lengths": lengths}
    real = inputs.attention_mask.bool()

    def front(packed: torch.Tensor) -> torch.Tensor:
        """Packed input rows -> packed rows at the cut (privacy.Payload.front, as the client has it)."""
        padded = torch.zeros(inputs.hidden_states.shape, dtype=packed.dtype).index_put((real,), packed)
        out = run_decoder_layers(model, padded, inputs.attention_mask, inputs.position_ids, 0, knowledge.first_cut)
        return out[real]

    # The front's inputs and the front itself, for defenses that look through it (PriPert).
    return {"rows": rows, "lengths": lengths, "inputs": inputs.hidden_states[real], "front": front}


@pytest.fixture
def client_activation():
    return _client_activation


def _swap_images_within_batch(knowledge: AttackerKnowledge):
    """A 'defense' that sends each sample's visual rows under its neighbour's text: the rows keep
    their distribution but no longer show the sample's own image."""
    prefix, visual = knowledge.prefix_ids.numel(), knowledge.num_patches

    def defense(tensors):
        samples = [rows.clone() for rows in split_packed(tensors["rows"], tensors["lengths"])]
        images = [rows[prefix : prefix + visual].clone() for rows in samples]
        for i, rows in enumerate(samples):
            rows[prefix : prefix + visual] = images[(i + 1) % len(samples)]
        return {**tensors, "rows": torch.cat(samples)}

    return defense


@pytest.fixture
def swap_images_within_batch():
    return _swap_images_within_batch


Defense = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _defended_config(defenses: str, options: dict | None = None) -> SimConfig:
    """A tiny USL run's config with `defenses` at the cut and `options` ({"sparsify.ratio": 0.6})."""
    return load_config({"output.name": "defended", "model.profile": "tiny", "privacy.defenses": defenses,
                        **{f"privacy.{key}": value for key, value in (options or {}).items()}})


@pytest.fixture
def defended_config():
    return _defended_config


def _client_defense(config: SimConfig) -> Defense:
    """The run's ACTIVATION defenses as a client applies them to each activation it sends (its own
    privacy seed, one step per call), as a `record_activations` defense."""
    chain = build_defenses(config)
    steps = iter(range(1, 1_000_000))

    def defense(tensors):
        payload = Payload(tensors["rows"], tensors["lengths"], inputs=tensors["inputs"], front=tensors["front"])
        rows = chain.apply((ACTIVATION,), payload, chain.seed_for(0, 1, next(steps))).rows
        return {**tensors, "rows": rows.detach()}

    return defense


@pytest.fixture
def client_defense():
    return _client_defense


@pytest.fixture
def record_activations(tmp_path: Path, knowledge):
    """Record a client's first-cut activations for `samples` (batches of `batch_size`), optionally
    pruned/shuffled by `keep` and altered by `defense` (`defenses`: the header's description of
    them, as a run's recording has); returns the recording and its truth."""

    def record(samples, *, batch_size=8, keep=None, defense: Defense | None = None, pruning="off",
               model=None, name="recording", defenses: list | None = None):
        header = {"config": {"paradigm": "usl", "pruning.policy": pruning}}
        if defenses is not None:
            header["defenses"] = defenses
        recorder = Recorder(tmp_path / name, header=header)
        samples_by_seq, keep_by_seq = {}, {}
        for start in range(0, len(samples), batch_size):
            batch = samples[start : start + batch_size]
            batch_keep = None if keep is None else keep[start : start + batch_size]
            tensors = _client_activation(knowledge, model or knowledge.model, batch, batch_keep,
                                         with_front=defense is not None)
            if defense is not None:
                tensors = defense(tensors)
            # What the wire carries: the front's inputs and the front itself stay on the client.
            tensors = {key: value for key, value in tensors.items() if key not in ("inputs", "front")}
            entry = recorder.record(1, 1, "activation at CA", tensors)
            samples_by_seq[entry.seq] = list(batch)
            if batch_keep is not None:
                keep_by_seq[entry.seq] = list(batch_keep)
        return Recording.open(tmp_path / name), StaticTruth(samples_by_seq, keep_by_seq)

    return record
