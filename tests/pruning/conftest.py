"""Real easy-VQA samples, the word tokenizer the small models read, and seeded random encoders."""

from dataclasses import replace

import pytest

from pruning import build_random_encoders, get_pruning_profile
from vlm.mini.tokenizer import build_word_tokenizer
from vqa import load_vqa

SMALL_PROFILES = ("tiny", "mini")


@pytest.fixture(scope="session")
def samples():
    """Twelve training questions, plus another question about the first image and the
    first question about the second image: images and questions repeat, as in the data."""
    loaded = list(load_vqa("easyvqa", "train", limit=12))
    first, second = loaded[:2]
    return [
        *loaded,
        replace(first, id=f"{first.id}-again", question="what color is the shape?"),
        replace(second, id=f"{second.id}-again", question=first.question),
    ]


@pytest.fixture(scope="session")
def tokenizer(samples):
    return build_word_tokenizer([f"{sample.question} {sample.answer}" for sample in samples])


@pytest.fixture(scope="session", params=SMALL_PROFILES)
def profile(request):
    return get_pruning_profile(request.param)


@pytest.fixture(scope="session")
def encoders(profile, tokenizer):
    return build_random_encoders(profile, tokenizer)
