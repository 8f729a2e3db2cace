"""Frozen per-sample inputs: encoded once per image id and question, saved, and never mixed across encoders."""

import pytest
import torch

from pruning import PruningInputCache, build_random_encoders


class CountingEncoders:
    """Wraps encoders to count how many images and questions reach them."""

    def __init__(self, encoders) -> None:
        self.inner, self.images, self.questions = encoders, 0, 0
        self.fingerprint = encoders.fingerprint

    def encode_images(self, images):
        self.images += len(images)
        return self.inner.encode_images(images)

    def encode_questions(self, questions):
        self.questions += len(questions)
        return self.inner.encode_questions(questions)


def test_each_image_and_question_is_encoded_once(encoders, samples):
    counting = CountingEncoders(encoders)
    cache = PruningInputCache(counting, batch_size=4)
    cache.add(samples)
    cache.add(samples[:5])
    assert counting.images == len({sample.image_id for sample in samples}) < len(samples)
    assert counting.questions == len({sample.question for sample in samples})
    torch.testing.assert_close(cache.dino_patches(samples[:2]), encoders.encode_images([s.image for s in samples[:2]]))
    torch.testing.assert_close(
        cache.question_vectors(samples[:2]), encoders.encode_questions([s.question for s in samples[:2]])
    )


def test_an_unknown_sample_is_named(encoders, samples):
    cache = PruningInputCache(encoders)
    with pytest.raises(KeyError, match=repr(samples[0].image_id)):
        cache.dino_patches(samples[:1])
    with pytest.raises(KeyError, match="no cached question vector"):
        cache.question_vectors(samples[:1])


def test_a_saved_cache_loads_only_into_the_same_encoders(encoders, samples, tokenizer, tmp_path):
    cache = PruningInputCache(encoders)
    cache.add(samples)
    cache.save(tmp_path / "inputs.pt")
    restored = PruningInputCache(CountingEncoders(encoders))
    restored.load(tmp_path / "inputs.pt")
    restored.add(samples)
    assert restored.encoders.images == restored.encoders.questions == 0
    assert torch.equal(restored.dino_patches(samples), cache.dino_patches(samples))
    assert torch.equal(restored.question_vectors(samples), cache.question_vectors(samples))
    other = PruningInputCache(build_random_encoders(encoders.profile, tokenizer, seed=7))
    with pytest.raises(ValueError, match="computed by encoders .* delete it to recompute"):
        other.load(tmp_path / "inputs.pt")
