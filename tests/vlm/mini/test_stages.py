"""The stages' data: conversations, generated instructions and the base's check questions;
the learning-rate schedule; the recipe's checks on its settings."""

import random
import re
from collections import Counter

import pytest
import torch
from transformers import get_wsd_schedule

from vlm.mini.attributes import COLORS, SHAPES, ImageAttributes, image_attributes
from vlm.mini.recipe import MiniRecipe
from vlm.mini.stages import (
    StageSchedule,
    distinct_instructions,
    image_conversations,
    interleaved_conversation,
    own_wording_yes_no,
    pretrain_vision,
)
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


def test_an_interleaved_conversation_is_demonstrations_and_a_target_of_one_task():
    samples = list(load_vqa("easyvqa", "train"))[:600]
    attributes = image_attributes(samples)
    recipe, rng = MiniRecipe(base_interleaved_share=0.5), random.Random(0)
    hidden_seen = 0
    for _ in range(300):
        turns = interleaved_conversation(attributes, sorted(attributes), rng, recipe)
        assert 2 <= len(turns) <= recipe.base_interleaved_max_demos + 1
        assert len({image_id for image_id, _, _ in turns}) == len(turns)
        questions = {question for _, question, _ in turns}
        if questions <= set(recipe.interleaved_hidden_questions):
            hidden_seen += 1
            assert len(questions) == 1
            # Which attribute is asked shows only in the answers, and they agree on it.
            kinds = {"color" if a in COLORS else "shape" if a in SHAPES else "caption" for _, _, a in turns}
            assert len(kinds) == 1
            for image_id, _, answer in turns:
                seen = attributes[image_id]
                assert answer in (seen.color, seen.shape, seen.caption())
    assert 100 < hidden_seen < 200


def test_a_repeat_instruction_answers_the_attribute_its_question_names_not_the_one_seen():
    rng, recipe = random.Random(0), MiniRecipe()
    attributes = ImageAttributes(shape="circle", color="red")
    repeats = [
        (question, answer)
        for question, answer in (distinct_instructions(attributes, 1, rng, recipe)[0] for _ in range(2000))
        if question.startswith("Repeat the ")
    ]
    assert 0.1 < len(repeats) / 2000 < 0.4
    for question, answer in repeats:
        attribute, named = question.removeprefix("Repeat the ").split(": ", 1)
        assert named in {w.format(answer) for w in (recipe.color_yes_no_wordings + recipe.shape_yes_no_wordings)}
        assert answer in (COLORS if attribute == "color" else SHAPES)
    assert {answer for _, answer in repeats} - {"red", "circle"}, "only ever repeated the attribute seen"


def test_own_wording_checks_ask_colour_and_shape_of_each_image_and_answer_them_truly():
    samples = list(load_vqa("easyvqa", "train"))[:600]
    attributes = image_attributes(samples)
    recipe = MiniRecipe()
    questions = own_wording_yes_no(samples, attributes, recipe, random.Random(0))
    vocabulary = {"color": (recipe.color_yes_no_wordings, COLORS), "shape": (recipe.shape_yes_no_wordings, SHAPES)}
    for question in questions:
        kind = question.question_kind.split()[1]
        wordings, values = vocabulary[kind]
        asked = next(word for word in re.findall(r"[a-z]+", question.question) if word in values)
        assert question.question in {wording.format(asked) for wording in wordings}
        truth = getattr(attributes[question.image_id], kind)
        assert question.answer == ("yes" if asked == truth else "no")
    expected = sum(bool(a.color) + bool(a.shape) for a in attributes.values())
    assert len(questions) == expected
    assert 0.35 < Counter(q.answer for q in questions)["yes"] / len(questions) < 0.65
    assert [q.question for q in questions] == [
        q.question for q in own_wording_yes_no(samples, attributes, recipe, random.Random(0))
    ]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"base_all_tokens_turns": 3}, "base_all_tokens_turns=3: must be a positive divisor of base_batch_size=64"),
        ({"base_all_tokens_turns": 0}, "base_all_tokens_turns=0"),
        ({"vqa_max_turns": 0}, "vqa_max_turns=0: must be at least 1"),
        ({"vision_token_loss_weight": -1.0}, "vision_token_loss_weight=-1.0: must be >= 0"),
        ({"base_few_tokens_max_steps": 2000}, "base_few_tokens_max_steps=2000: must be at least the 2625 planned"),
        ({"base_check_every": 0}, "base_check_every=0: must be at least 1"),
        ({"base_check_accuracy": 1.5}, r"base_check_accuracy=1.5: must be within \[0, 1\]"),
        ({"base_attempts": 0}, "base_attempts=0: must be at least 1"),
        ({"vqa_random_keep_share": -0.1}, r"vqa_random_keep_share=-0.1: must be within \[0, 1\]"),
        ({"vision_position_loss_weight": -1.0}, "vision_position_loss_weight=-1.0: must be >= 0"),
        ({"base_interleaved_share": 1.5}, r"base_interleaved_share=1.5: must be within \[0, 1\]"),
        ({"base_interleaved_max_demos": 0}, "base_interleaved_max_demos=0: must be at least 1"),
    ],
)
def test_recipe_rejects_settings_that_do_not_fit(settings, message):
    with pytest.raises(ValueError, match=message):
        MiniRecipe(**settings)


@pytest.mark.parametrize(("steps", "decay_share"), [(200, 0.25), (37, 0.5), (10, 0.0)])
def test_the_stage_schedule_is_transformers_warmup_stable_decay(steps, decay_share):
    schedule = StageSchedule.with_decay_share(steps, decay_share)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_wsd_schedule(
        optimizer, num_warmup_steps=round(0.05 * steps), num_decay_steps=round(decay_share * steps),
        num_training_steps=steps,
    )
    assert schedule.total_steps == steps
    for step in range(steps):
        assert schedule(step) == pytest.approx(reference.lr_lambdas[0](step), abs=1e-12)


def test_lengthening_the_constant_part_delays_the_decay():
    schedule = StageSchedule(warmup_steps=2, constant_steps=3, decay_steps=4)
    before = [schedule(step) for step in range(9)]
    schedule.constant_steps += 5
    after = [schedule(step) for step in range(14)]
    assert after[:5] == before[:5] and after[5:10] == [1.0] * 5 and after[10:] == before[5:]


def test_a_field_added_at_its_default_keeps_every_earlier_build_s_cache_key():
    import hashlib
    import json
    from dataclasses import asdict

    recipe = MiniRecipe()
    added_later = {"vision_position_loss_weight", "base_interleaved_share", "base_interleaved_max_demos",
                   "base_interleaved_hidden_share", "interleaved_hidden_questions"}
    earlier = {k: v for k, v in asdict(recipe).items() if k not in added_later}
    assert recipe.fingerprint() == hashlib.sha256(json.dumps(earlier, sort_keys=True).encode()).hexdigest()[:12]
    assert recipe.fingerprint() == "1869deac289f"
    assert MiniRecipe(vision_position_loss_weight=1.0).fingerprint() != recipe.fingerprint()
    assert MiniRecipe(base_interleaved_share=0.5).fingerprint() != recipe.fingerprint()


def test_the_position_loss_makes_the_features_name_their_patch():
    """The vision stage with and without `vision_position_loss_weight`, on the tiny tower: a linear
    probe reads each feature's patch far better after the stage that asks for it."""
    from sklearn.linear_model import LogisticRegression

    from vlm.loading import build_random_model, clip_image_preprocessor
    from vlm.profiles import TINY
    from vlm.segments import vision_features

    samples = list({s.image_id: s for s in load_vqa("easyvqa", "train", limit=400, seed=0)}.values())[:96]
    pixels = clip_image_preprocessor(TINY.image_size)([s.image for s in samples])
    attributes = image_attributes(samples)
    labels = [attributes[s.image_id] for s in samples]
    accuracy = {}
    for weight in (0.0, 1.0):
        model = build_random_model(TINY, seed=0)
        recipe = MiniRecipe(vision_steps=150, vision_batch_size=16, vision_position_loss_weight=weight)
        pretrain_vision(model, pixels, labels, recipe, progress=False)
        with torch.no_grad():
            features = vision_features(model, pixels)
        n = features.shape[1]
        x, y = features.flatten(0, 1).numpy(), torch.arange(n).repeat(len(samples)).numpy()
        split = 64 * n  # the first 64 images train the probe, the rest score it
        accuracy[weight] = LogisticRegression(max_iter=500).fit(x[:split], y[:split]).score(x[split:], y[split:])
    assert accuracy[1.0] > 0.6 and accuracy[1.0] > accuracy[0.0] + 0.3, accuracy
