"""Position probes (attacks/position_probes.py): the rows they read, their labels, and that they
read position where the tiny tower has it (its positional embeddings) and nothing where it has none."""

import json

import numpy as np
import pytest
import torch

from attacks.position_probes import PositionProbeOptions, distinct_images, probe_accuracy, rows_by_place


@pytest.fixture(scope="module")
def places(knowledge, aux):
    return rows_by_place(knowledge, distinct_images(aux)[:48], seed=3)


def test_each_place_has_one_row_per_patch_and_image_labelled_by_its_patch(knowledge, aux, places):
    images = distinct_images(aux)[:48]
    n = knowledge.num_patches
    names = [place.place for place, _, _ in places]
    assert names == ["vision embeddings", "vision layer 1", "cut 1 (patch order)", "cut 1 (shuffled order)"]
    for place, rows, labels in places:
        assert rows.shape[:2] == labels.shape == (len(images), n)
        # Every image's labels are a permutation of the patch indices.
        assert torch.equal(labels.sort(dim=1).values, torch.arange(n).expand(len(images), n))
    (_, in_order, order_labels), (_, shuffled, shuffle_labels) = places[2], places[3]
    assert torch.equal(order_labels, torch.arange(n).expand(len(images), n))
    assert not torch.equal(shuffle_labels, order_labels)
    # The last vision place is what LLaVA reads: the features every client sends on.
    torch.testing.assert_close(places[1][1], knowledge.features(knowledge.pixel_values(images)).float())
    # Shuffled rows are computed in the sent order, not permuted after the fact: the decoder's
    # rotary positions make them differ from the patch-order rows of the same patches.
    regathered = torch.stack([in_order[i, shuffle_labels[i]] for i in range(len(images))])
    assert not torch.allclose(regathered, shuffled, atol=1e-4)


def test_the_linear_probe_reads_position_off_the_embeddings_and_nothing_off_shuffled_labels(places):
    options = PositionProbeOptions(probes=("linear",))
    _, rows, labels = places[0]
    chance = 1 / labels.shape[1]
    assert probe_accuracy(rows, labels, "linear", options) > 6 * chance
    # The same rows with labels that no longer belong to them: a probe that reads position
    # (and not, say, the label's frequency) falls to chance.
    generator = torch.Generator().manual_seed(0)
    unrelated = torch.stack([label[torch.randperm(label.numel(), generator=generator)] for label in labels])
    assert probe_accuracy(rows, unrelated, "linear", options) < 2 * chance


def test_the_probes_score_only_on_images_they_never_trained_on(places):
    _, rows, labels = places[0]
    # Rows of the held-out images replaced by noise: were they in training, the score would not fall.
    options = PositionProbeOptions(probes=("linear",), test_share=0.5)
    clean = probe_accuracy(rows, labels, "linear", options)
    order = torch.from_numpy(np.random.default_rng(options.seed).permutation(rows.shape[0]))
    noisy = rows.clone()
    noisy[order[: rows.shape[0] // 2]] = torch.randn_like(noisy[order[: rows.shape[0] // 2]])
    assert probe_accuracy(noisy, labels, "linear", options) < clean / 3


def test_bad_options_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="test_share=1"):
        PositionProbeOptions(test_share=1)
    with pytest.raises(ValueError, match="probes=\\('cnn',\\)"):
        PositionProbeOptions(probes=("cnn",))


def test_the_command_on_tiny_writes_one_row_per_place(tmp_path):
    from sims.privacy_cli import main

    out = tmp_path / "report"
    assert main(["positions", "--profile", "tiny", "--stage", "random", "--images", "16", "--probes", "linear",
                 "--no-progress", "--out", str(out)]) == 0
    report = json.loads((out / "positions.json").read_text())
    assert [p["place"] for p in report["places"]] == [
        "vision embeddings", "vision layer 1", "cut 2 (patch order)", "cut 2 (shuffled order)"]
    assert report["images"] == 16 and report["num_patches"] == 16 and report["feature_layer"] == 1
    assert all(set(p["accuracy"]) == {"linear"} for p in report["places"])
    rows = [line for line in (out / "positions.md").read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 4
    assert (out / "positions.png").stat().st_size > 0


@pytest.mark.parametrize("arguments,message", [
    (["--images", "1"], "--images 1: must be at least 2"),
    (["--test-share", "0"], "--test-share 0.0: must be in (0, 1)"),
    (["--probes", "linear,cnn"], "--probes 'linear,cnn': a comma-separated subset of linear, mlp"),
])
def test_the_command_refuses_bad_arguments_saying_which(arguments, message, capsys, tmp_path):
    from sims.privacy_cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["positions", "--profile", "tiny", "--out", str(tmp_path), *arguments])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())

