"""Shared tiny-model fixtures for the vlm tests: random weights, fp32, built in milliseconds."""

import pytest
import torch

from vlm.loading import build_random_model
from vlm.profiles import TINY

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


@pytest.fixture(params=ATTENTION_IMPLEMENTATIONS)
def tiny_model(request: pytest.FixtureRequest):
    return build_random_model(TINY, seed=0, attn_implementation=request.param)


@pytest.fixture
def pixel_values() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(3, 3, TINY.image_size, TINY.image_size, generator=generator)


def _random_prompts(
    lengths_before: list[int], lengths_after: list[int], seed: int = 2
) -> list[torch.Tensor]:
    """Prompts of uneven length with one image placeholder, drawn from ordinary token ids."""
    generator = torch.Generator().manual_seed(seed)
    ordinary_ids = TINY.image_token_id - 1  # ids [1, image_token_id) never collide with image/pad ids
    prompts = []
    for before, after in zip(lengths_before, lengths_after, strict=True):
        prompts.append(
            torch.cat(
                [
                    torch.randint(1, ordinary_ids, (before,), generator=generator),
                    torch.tensor([TINY.image_token_id]),
                    torch.randint(1, ordinary_ids, (after,), generator=generator),
                ]
            )
        )
    return prompts


def _random_answers(lengths: list[int], seed: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, TINY.image_token_id - 1, (n,), generator=generator) for n in lengths]


@pytest.fixture
def make_prompts():
    return _random_prompts


@pytest.fixture
def make_answers():
    return _random_answers
