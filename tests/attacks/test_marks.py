"""The stamped benchmark's read-back: the probe reads marks off real images, not off a guess."""

import pytest

from attacks import build_attack
from attacks.marks import MarkReader, mark_readback, public_marks
from vqa import load_vqa
from vqa import mark_records


@pytest.fixture(scope="module")
def stamped():
    """Stamped victims (training split) and auxiliary images (test split: other handwriting)."""
    victims = list(load_vqa("easyvqa-stamped", "train", limit=160, seed=0))
    aux = list(load_vqa("easyvqa-stamped", "test", limit=400, seed=1))
    marks = {**mark_records("easyvqa-stamped", "train"), **mark_records("easyvqa-stamped", "test")}
    return victims, aux, marks


def test_the_probe_reads_marks_off_the_images_and_a_guess_reads_no_more_than_chance(knowledge, stamped):
    victims, aux, marks = stamped
    aux = [s for s in aux if s.image_id in marks]
    victims = [s for s in victims if s.image_id in marks]
    aux_images = knowledge.unit_images(knowledge.pixel_values(aux))
    reader = MarkReader().fit(aux_images, [marks[s.image_id] for s in aux])
    originals = knowledge.unit_images(knowledge.pixel_values(victims))
    victim_marks = [marks[s.image_id] for s in victims]
    guess = aux_images.mean(0, keepdim=True).expand_as(originals)
    read = mark_readback(reader, guess, originals, victim_marks)
    print(read)
    assert read["mark_readback_originals"] > 2 * read["mark_readback_chance"]
    assert read["mark_readback"] <= read["mark_readback_chance"]


def test_image_attacks_report_the_read_back_on_stamped_data(knowledge, stamped, record_activations):
    victims, aux, marks = stamped
    recording, truth = record_activations(victims[:16])
    truth.marks_by_image = marks
    result = build_attack("fora", knowledge, substitute_steps=1, decoder_steps=1, progress=False).fit(aux[:200]).run(
        recording, truth
    )
    marked = sum(s.image_id in marks for s in victims[:16])
    assert result.metrics["marked_samples"] == marked > 0
    assert 0 <= result.metrics["mark_readback"] <= 1


def test_the_attackers_own_images_marks_come_from_their_splits_public_records(stamped):
    victims, aux, marks = stamped
    # The run's truth knows the victims' marks only; the attacker's images' come from its split's records.
    found = public_marks([*aux[:50], *victims[:50]])
    assert found == [marks.get(s.image_id) for s in [*aux[:50], *victims[:50]]]
    assert any(mark is not None for mark in found[:50])
    assert public_marks(list(load_vqa("easyvqa", "test", limit=5, seed=0))) == [None] * 5
