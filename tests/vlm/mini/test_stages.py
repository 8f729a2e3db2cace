"""How the stages cut the data into conversations, and the recipe's checks on its settings."""

import random
from collections import Counter

import pytest

from vlm.mini.attributes import ImageAttributes
from vlm.mini.recipe import MiniRecipe
from vlm.mini.stages import distinct_instructions, image_conversations
from vqa import load_vqa


@pytest.mark.parametrize("max_turns", [1, 3, 8])
def test_every_question_lands_in_one_conversation_about_its_own_image(max_turns):
    samples = list(load_vqa("easyvqa", "test"))[:400]
    conversations = image_conversations(samples, max_turns, random.Random(0))
    assert Counter(s.id for turns in conversations for s in turns) == Counter(s.id for s in samples)
    assert all(1 <= len(turns) <= max_turns for turns in conversations)
    assert all(len({s.image_id for s in turns}) == 1 for turns in conversations)
    per_image = Counter(s.image_id for s in samples)
    # Near-equal parts: an image's conversations differ by at most one turn.
    sizes: dict[str, list[int]] = {}
    for turns in conversations:
        sizes.setdefault(turns[0].image_id, []).append(len(turns))
    assert all(max(s) - min(s) <= 1 and sum(s) == per_image[image] for image, s in sizes.items())


def test_conversations_follow_the_seed():
    samples = list(load_vqa("easyvqa", "test"))[:200]

    def ids(seed):
        return [[s.id for s in turns] for turns in image_conversations(samples, 4, random.Random(seed))]

    assert ids(0) == ids(0)
    assert ids(0) != ids(1)


def test_a_base_conversation_never_repeats_a_question():
    rng, recipe = random.Random(0), MiniRecipe()
    for _ in range(200):
        turns = distinct_instructions(ImageAttributes(shape="circle", color="red"), 4, rng, recipe)
        assert len(turns) == 4
        assert len({question for question, _ in turns}) == 4


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"base_all_tokens_turns": 3}, "base_all_tokens_turns=3: must be a positive divisor of base_batch_size=64"),
        ({"base_all_tokens_turns": 0}, "base_all_tokens_turns=0"),
        ({"vqa_max_turns": 0}, "vqa_max_turns=0: must be at least 1"),
        ({"vision_token_loss_weight": -1.0}, "vision_token_loss_weight=-1.0: must be >= 0"),
    ],
)
def test_recipe_rejects_turn_settings_that_do_not_fit(settings, message):
    with pytest.raises(ValueError, match=message):
        MiniRecipe(**settings)
