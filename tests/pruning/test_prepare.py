"""Preparing DTP: the oracle's scan, MIL pooling, the distillation loss, resumable stages, and options."""

import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import CLIPImageProcessorPil, CLIPTextConfig, CLIPTextModel, Dinov2Config, Dinov2Model
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from pruning import build_qpriv_vl, get_pruning_profile, keep_indices, load_dtp, load_encoders, load_oracle, oracle_key
from pruning.cli import main
from pruning.prepare import (
    NO_MATCH_RATIO,
    ORACLE_GRID,
    STAGES_FOLDER,
    TRAIN_SPLIT,
    PrepareError,
    PrepareSettings,
    StageCache,
    bag_logits,
    distillation_loss,
    load_frozen_inputs,
    load_preparation_data,
    prepare_dtp,
    run_sensitivity,
    search_oracle,
    teacher_mask,
)
from vlm.answering import answer_questions
from vlm.mini.tokenizer import build_sample_tokenizer
from vlm.profiles import build_llava_config, get_profile
from vqa import first_token_substring_match, load_vqa

# Small enough for seconds on the tiny profile, large enough that every stage has batches.
TINY = PrepareSettings(
    profile="tiny",
    model_stage="random",
    samples=48,
    oracle_samples=32,
    eval_oracle_samples=16,
    bag_samples=32,
    sensitivity_epochs=2,
    threshold_epochs=2,
    student_epochs=2,
    batch_size=16,
)


def correct_at(table: dict[str, set[float]]):
    """A matcher answering correctly exactly at the ratios `table` lists per sample id,
    recording every (ratio, sample ids) call."""
    calls = []

    def matches(ratio, batch):
        calls.append((ratio, [sample.id for sample in batch]))
        return [ratio in table[sample.id] for sample in batch]

    return matches, calls


@pytest.mark.parametrize(
    ("direction", "expected", "scan"),
    [
        ("smallest", {"a": 0.3, "b": 0.1, "c": NO_MATCH_RATIO, "d": 0.7}, [0.1, 0.2, 0.3, 0.5, 0.7]),
        ("largest", {"a": 0.5, "b": 0.7, "c": NO_MATCH_RATIO, "d": 0.7}, [0.7, 0.5, 0.3, 0.2, 0.1]),
    ],
)
def test_the_oracle_keeps_the_first_matching_ratio_in_its_scan_order(direction, expected, scan, samples):
    # b matches at both ends of the grid: only the direction decides which ratio it gets.
    table = {"a": {0.3, 0.5}, "b": {0.1, 0.7}, "c": set(), "d": {0.7}}
    batch = [replace(samples[0], id=name) for name in table]
    matches, calls = correct_at(table)
    ratios = search_oracle(batch, ORACLE_GRID, direction, matches)
    assert ratios == {oracle_key(sample): expected[sample.id] for sample in batch}
    assert [ratio for ratio, _ in calls] == scan
    # A sample that matched is never answered again; the unmatched are asked at every ratio.
    asked = [name for _, names in calls for name in names]
    assert asked.count("c") == len(scan)
    assert all(asked.count(name) == scan.index(expected[name]) + 1 for name in ("a", "b", "d"))
    # Once every sample has matched, the scan stops.
    matches, calls = correct_at(table)
    search_oracle(batch[1:2], ORACLE_GRID, direction, matches)
    assert calls == [(scan[0], ["b"])]


def test_the_stable_oracle_keeps_the_last_ratio_before_the_first_miss(samples):
    # b's lucky match at 0.7 after a miss at 0.2 does not count; e matches everywhere.
    table = {"a": {0.3, 0.5}, "b": {0.1, 0.7}, "c": set(), "d": {0.1, 0.2, 0.3}, "e": set(ORACLE_GRID)}
    batch = [replace(samples[0], id=name) for name in table]
    matches, calls = correct_at(table)
    ratios = search_oracle(batch, ORACLE_GRID, "stable", matches)
    expected = {"a": NO_MATCH_RATIO, "b": 0.1, "c": NO_MATCH_RATIO, "d": 0.3, "e": max(ORACLE_GRID)}
    assert ratios == {oracle_key(sample): expected[sample.id] for sample in batch}
    # A sample leaves the scan at its first miss.
    asked = [name for _, names in calls for name in names]
    assert {name: asked.count(name) for name in table} == {"a": 1, "b": 2, "c": 1, "d": 4, "e": len(ORACLE_GRID)}


def test_the_grid_is_scanned_in_order_whatever_order_it_is_given_in():
    settings = PrepareSettings(grid=(0.5, 0.1, 0.3))
    assert settings.grid == (0.1, 0.3, 0.5)


def test_the_bag_logit_is_the_max_of_its_patch_logits():
    patch_logits = torch.tensor([[[-2.0], [3.0], [0.5]], [[-1.0], [-4.0], [-0.5]]])
    torch.testing.assert_close(bag_logits(patch_logits), torch.tensor([3.0, -0.5]))


def test_the_mil_teacher_marks_the_private_patch_not_its_neighbours():
    """From image labels alone, H_sens learns which patch made a bag private: the planted
    patch ends up above 0.5 and every other patch, in private bags too, below it, so a
    bag's max patch sensitivity (the threshold head's summary) tells its label."""
    profile = get_pruning_profile("tiny")
    generator = torch.Generator().manual_seed(0)
    bags, patches, width = 256, profile.dino_grid**2, profile.dino_hidden_size
    features = torch.randn(bags, patches, width, generator=generator)
    labels = (torch.arange(bags) % 2).float()
    planted_at = torch.randint(patches, (bags,), generator=generator)
    mark = 3 * torch.randn(width, generator=generator)
    positives = labels.bool()
    features[positives, planted_at[positives]] += mark
    frozen = SimpleNamespace(bag_patches={TRAIN_SPLIT: features}, bag_labels={TRAIN_SPLIT: labels})
    teacher = build_qpriv_vl(profile, seed=0)
    settings = PrepareSettings(profile="tiny", model_stage="random", sensitivity_epochs=40, lr=1e-2, batch_size=64)
    run_sensitivity(settings, frozen, teacher, progress=False)
    with torch.no_grad():
        sensitivity = teacher.patch_sensitivity(features)
    planted = torch.zeros(bags, patches, dtype=torch.bool)
    planted[positives, planted_at[positives]] = True
    assert sensitivity[planted].min() > 0.5
    assert sensitivity[~planted].mean() < 0.2
    assert sensitivity[positives][~planted[positives]].mean() < 0.2
    assert torch.equal(sensitivity.amax(dim=1) > 0.5, positives)


def test_the_distillation_loss_fits_teacher_and_oracle_ratios_and_the_mask():
    ratio = torch.tensor([0.5, 0.5, 0.5], requires_grad=True)
    soft_mask = torch.tensor([[0.6, 0.2], [0.5, 0.5], [0.1, 0.9]], requires_grad=True)
    teacher_ratio = torch.tensor([0.3, 0.7, 0.5])
    oracle_ratio = torch.tensor([0.1, 0.0, 1.0])
    has_oracle = torch.tensor([True, False, True])
    mask_target = torch.tensor([[0.4, 0.2], [0.5, 0.5], [0.1, 0.5]])
    losses = distillation_loss(
        ratio, soft_mask, teacher_ratio, oracle_ratio, has_oracle, mask_target, lambda_ratio=2.0, lambda_mask=3.0
    )
    to_teacher = (0.2**2 + 0.2**2 + 0) / 3
    to_oracle = (0.4**2 + 0.5**2) / 2  # the middle sample has no oracle ratio: its 0.0 is ignored
    mask = (0.2**2 + 0.4**2) / 6
    expected = {
        "ratio_to_teacher": to_teacher,
        "ratio_to_oracle": to_oracle,
        "ratio": to_teacher + to_oracle,
        "mask": mask,
    }
    for name, value in expected.items():
        assert losses[name].item() == pytest.approx(value), name
    assert losses["loss"].item() == pytest.approx(2.0 * (to_teacher + to_oracle) + 3.0 * mask)
    losses["loss"].backward()
    assert ratio.grad.abs().sum() > 0 and soft_mask.grad.abs().sum() > 0

    unlabelled = distillation_loss(
        ratio,
        soft_mask,
        teacher_ratio,
        oracle_ratio,
        torch.zeros(3, dtype=torch.bool),
        mask_target,
        lambda_ratio=1.0,
        lambda_mask=1.0,
    )
    assert unlabelled["ratio_to_oracle"].item() == 0.0


def test_the_mask_target_fuses_fixed_relevance_with_teacher_sensitivity():
    relevance, sensitivity = torch.tensor([[0.9, 0.1]]), torch.tensor([[0.2, 0.8]])
    torch.testing.assert_close(
        teacher_mask(relevance, sensitivity, 1.0, 1.0), torch.sigmoid(3 * (relevance - sensitivity))
    )
    # α = 0: privacy alone decides, whatever the relevance.
    torch.testing.assert_close(teacher_mask(relevance, sensitivity, 0.0, 1.0), torch.sigmoid(-3 * sensitivity))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("dtp")
    return out, prepare_dtp(TINY, out, progress=False)


def test_prepare_writes_the_artefacts_and_a_report(prepared):
    out, report = prepared
    assert {path.name for path in out.iterdir()} == {"dtp.pt", "oracle.pt", "prepare.json", STAGES_FOLDER}
    assert sorted(path.name.split("-")[0] for path in (out / STAGES_FOLDER).iterdir()) == [
        "oracle",
        "sensitivity",
        "student",
        "threshold",
    ]
    data = report["data"]
    assert (data["training_samples"], data["oracle_samples"], data["held_out_oracle_samples"]) == (48, 32, 16)
    assert {split: sum(counts.values()) for split, counts in data["bags"].items()} == {"train": 32, "test": 32}
    stages = report["stages"]
    assert sum(stages["oracle"]["train"]["histogram"].values()) == 32
    assert set(stages["oracle"]["train"]["histogram"]) <= {f"{ratio:.2f}" for ratio in (*ORACLE_GRID, NO_MATCH_RATIO)}
    assert len(stages["student"]["epoch_losses"]) == 2
    assert set(stages["student"]["epoch_losses"][0]) == {"loss", "ratio", "ratio_to_teacher", "ratio_to_oracle", "mask"}
    assert stages["sensitivity"]["bag_accuracy"]["overall"]["count"] == 32
    assert stages["student"]["fit_to_oracle"]["held_out"]["count"] == 16
    assert all(not stage["cached"] and stage["seconds"] >= 0 for stage in stages.values())


def test_each_oracle_ratio_is_the_first_in_the_grid_that_still_answers_right(prepared):
    """The stored ratios against an independent replay: the stored scorer's top-k at each
    grid ratio, answered by the same model, scored by first-token substring match."""
    out, _ = prepared
    data = load_preparation_data(TINY)
    frozen = load_frozen_inputs(TINY, data, progress=False)
    scorer, ratios = load_oracle(out, frozen.profile, frozen.encoders, alpha=TINY.alpha, beta=TINY.beta)
    samples = [*data.oracle, *data.held_out]
    assert set(ratios) == {oracle_key(sample) for sample in samples}
    with torch.no_grad():
        score = scorer(*frozen.batch(samples)).score
    for ratio in ORACLE_GRID:
        kept = keep_indices(score, [ratio] * len(samples), frozen.profile.k_min)
        keep = {oracle_key(sample): indices for sample, indices in zip(samples, kept, strict=True)}

        def pruned(sample, tokens, keep=keep):
            return tokens[keep[oracle_key(sample)]]

        answers = answer_questions(
            frozen.model,
            frozen.tokenizer,
            frozen.vision,
            samples,
            instruction=frozen.instruction,
            visual_tokens=pruned,
            progress=False,
        )
        for sample, answer in zip(samples, answers, strict=True):
            found = ratios[oracle_key(sample)]
            if ratio < found:
                assert not first_token_substring_match(answer, sample.answer), (sample.id, ratio)
            elif ratio == found:
                assert first_token_substring_match(answer, sample.answer), (sample.id, ratio)


def test_a_rerun_reuses_every_stage_and_a_changed_setting_redoes_only_what_it_affects(prepared):
    out, first = prepared
    stage_files = {path.name: path.stat().st_mtime_ns for path in (out / STAGES_FOLDER).iterdir()}
    again = prepare_dtp(TINY, out, progress=False)
    assert all(stage["cached"] for stage in again["stages"].values())
    assert {path.name: path.stat().st_mtime_ns for path in (out / STAGES_FOLDER).iterdir()} == stage_files
    for name in ("oracle", "sensitivity", "threshold", "student"):
        assert again["stages"][name]["key"] == first["stages"][name]["key"]
        assert again["stages"][name]["seconds"] == first["stages"][name]["seconds"]

    def cached_after(**changes):
        report = prepare_dtp(replace(TINY, **changes), out, progress=False)
        return {name: stage["cached"] for name, stage in report["stages"].items()}

    assert cached_after(student_epochs=1) == {"oracle": True, "sensitivity": True, "threshold": True, "student": False}
    assert cached_after(direction="largest") == {
        "oracle": False,
        "sensitivity": True,
        "threshold": False,
        "student": False,
    }
    assert cached_after(sensitivity_epochs=1) == {
        "oracle": True,
        "sensitivity": False,
        "threshold": False,
        "student": False,
    }
    # Back to the first settings: everything comes from the cache again.
    assert all(stage["cached"] for stage in prepare_dtp(TINY, out, progress=False)["stages"].values())


def test_the_oracle_may_search_with_a_scorer_of_its_own(tmp_path, monkeypatch):
    """With trained towers the fixed scorer adopts their read-out; --oracle-scorer random keeps the
    paper's random scorer for the search alone, the teacher's mask keeping the read-out's. (Tiny
    has no towers: a stand-in read-out sets every Wq weight to one.)"""
    import pruning.prepare as prepare_module

    def adopt(scorer, encoders):
        with torch.no_grad():
            scorer.query_projection.weight.fill_(1.0)
        return True

    monkeypatch.setattr(prepare_module, "adopt_readout", adopt)
    report = prepare_dtp(replace(TINY, student_epochs=1, oracle_scorer="random"), tmp_path, progress=False)
    assert (report["fixed_scorer"], report["oracle_scorer"]) == ("pretrained read-out", "random")
    frozen = load_frozen_inputs(TINY, load_preparation_data(TINY), progress=False)
    searched, _ = load_oracle(tmp_path, frozen.profile, frozen.encoders, alpha=TINY.alpha, beta=TINY.beta)
    assert not torch.all(searched.query_projection.weight == 1.0)
    same = prepare_dtp(replace(TINY, student_epochs=1), tmp_path / "same", progress=False)
    assert same["oracle_scorer"] == "pretrained read-out"
    searched, _ = load_oracle(tmp_path / "same", frozen.profile, frozen.encoders, alpha=TINY.alpha, beta=TINY.beta)
    assert torch.all(searched.query_projection.weight == 1.0)


def test_an_interrupted_stage_is_not_taken_for_finished(tmp_path):
    cache = StageCache(tmp_path)

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.run("oracle", {"grid": [0.1]}, interrupted)
    result = cache.run("oracle", {"grid": [0.1]}, lambda: {"ratios": {"x": 0.1}})
    assert not result.cached and result.record["ratios"] == {"x": 0.1}
    assert cache.run("oracle", {"grid": [0.1]}, interrupted).cached


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--direction", "sideways"], "--direction='sideways' is not allowed; allowed: smallest, largest"),
        (["--grid", "0.1", "1.0"], "--grid=1.0 is not allowed; allowed: 0 < ρ < 1"),
        (["--grid", "0.1", "0.1"], "--grid=(0.1, 0.1) is not allowed; allowed: each ratio once"),
        (["--dataset", "easyvqa", "nope"], "--dataset='nope' is not allowed; allowed: easyvqa, easyvqa-stamped"),
        (["--bags", "mnist", "faces"], "--bags='faces' is not allowed; allowed: celeba, cifar10"),
        (
            ["--profile", "tiny"],
            "--profile='tiny' is not allowed; allowed: llava-1.5-7b, mini, mini-interleaved, mini-positional, "
            "mini-scenes with --model-stage vqa",
        ),
        (["--fixed-scorer", "clever"], "--fixed-scorer='clever' is not allowed; allowed: pretrained, random"),
        (["--oracle-scorer", "clever"], "--oracle-scorer='clever' is not allowed; allowed: pretrained, random or"),
        (["--model-source", "/llava"], "--model-source='/llava' is not allowed; allowed: '' (profile 'mini' at"),
        (["--profile", "llava-1.5-7b", "--dtype", "fp8"], "--dtype='fp8' is not allowed; allowed: fp32, bf16, fp16"),
        (["--device", "abacus"], "--device='abacus' is not allowed; allowed: a torch device"),
        (
            ["--oracle-samples", "600", "--samples", "500"],
            "--oracle-samples=600 is not allowed; allowed: 1..--samples (500)",
        ),
        (["--alpha", "0", "--beta", "0"], "--alpha=0.0 is not allowed"),
        (
            ["--source", "slake=/data/slake"],
            "--source='slake' is not allowed; allowed: a name given to --dataset or --bags",
        ),
    ],
)
def test_options_are_checked_before_anything_loads(arguments, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--out", str(tmp_path / "out"), *arguments])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bag_sets_with_a_single_label_are_refused():
    with pytest.raises(PrepareError, match="--bags=\\('easyvqa-stamped',\\) .*both private and public"):
        load_preparation_data(replace(TINY, bags=("easyvqa-stamped",), bag_samples=1))


# --- LLaVA-1.5-7B from local checkpoints ---------------------------------------------------


def save_stand_in_checkpoints(folder):
    """Local folders standing for LLaVA-1.5-7B, CLIP ViT-L/14-336 and DINOv2-S/14, as `hf download`
    leaves them: the widths and grids the 7B pruning profile reads (CLIP-L's 1024 at 336 px, the
    text tower's 768, DINOv2-S's 384 at patch 14), with one or two layers so that they run in seconds."""
    profile = get_pruning_profile("llava-1.5-7b")
    llava = profile.model
    tokenizer = build_sample_tokenizer(load_vqa("easyvqa-stamped", "train", limit=200))
    stand_in = replace(
        llava,
        vision={**llava.vision, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2},
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=1024),
        sl_cut=None,
        usl_cuts=None,
    )
    config = build_llava_config(
        stand_in, vocab_size=len(tokenizer), image_token_id=tokenizer.convert_tokens_to_ids(tokenizer.image_token),
        pad_token_id=tokenizer.pad_token_id,
    )
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": llava.image_size}, crop_size={"height": llava.image_size, "width": llava.image_size}
    )
    text = CLIPTextConfig(
        **{**profile.text, "num_hidden_layers": 1, "intermediate_size": 64}, vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlavaForConditionalGeneration(config).save_pretrained(folder / "llava")
        CLIPTextModel(text).save_pretrained(folder / "clip")
        Dinov2Model(Dinov2Config(**{**profile.dino, "num_hidden_layers": 1})).save_pretrained(folder / "dino")
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=llava.patch_size).save_pretrained(
        folder / "llava"
    )
    tokenizer.save_pretrained(folder / "clip")
    return {name: str(folder / name) for name in ("llava", "clip", "dino")}


LLAVA_SMALL_RUN = [
    "--profile", "llava-1.5-7b", "--samples", "8", "--oracle-samples", "4", "--eval-oracle-samples", "2",
    "--bag-samples", "16", "--sensitivity-epochs", "1", "--threshold-epochs", "1", "--student-epochs", "1",
    "--batch-size", "4", "--quiet",
]


def test_prepare_runs_for_llava_15_7b_from_local_checkpoints(tmp_path, capsys):
    sources = save_stand_in_checkpoints(tmp_path)
    out = tmp_path / "dtp"
    main(["prepare", "--out", str(out), *LLAVA_SMALL_RUN, "--model-source", sources["llava"],
          "--text-source", sources["clip"], "--dino-source", sources["dino"]])
    assert "artefacts and report in" in capsys.readouterr().out
    report = json.loads((out / "prepare.json").read_text())
    assert report["settings"]["profile"] == "llava-1.5-7b"
    assert report["data"]["oracle_samples"] == 4
    profile = get_pruning_profile("llava-1.5-7b")
    # The artefacts belong to the real encoders the sources hold (their fingerprint), on the 7B grids.
    encoders = load_encoders(
        profile, tokenizer=None, random_weights=False, text_source=sources["clip"], dino_source=sources["dino"]
    )
    module = load_dtp(out, profile, encoders, alpha=1.0, beta=1.0)
    _, ratios = load_oracle(out, profile, encoders, alpha=1.0, beta=1.0)
    assert len(ratios) == 6
    vision = torch.zeros(1, profile.num_patches, profile.vision_hidden_size)
    question = encoders.encode_questions(["what shape is in the image?"])
    dino = torch.zeros(1, profile.dino_grid**2, profile.dino_hidden_size)
    assert module(vision, question, dino).score.shape == (1, 576)


def test_prepare_without_the_real_weights_fails_before_any_data_loads(tmp_path, monkeypatch, capsys):
    sources = save_stand_in_checkpoints(tmp_path)

    def no_data(settings):
        raise AssertionError("the data loaded before the weights were checked")

    monkeypatch.setattr("pruning.prepare.load_preparation_data", no_data)
    for given, missing, hub_id in (
        ([], "profile 'llava-1.5-7b'", "llava-hf/llava-1.5-7b-hf"),
        (["--model-source", sources["llava"]], "the CLIP text tower", "openai/clip-vit-large-patch14-336"),
        (["--model-source", sources["llava"], "--text-source", sources["clip"]], "DINOv2", "facebook/dinov2-small"),
    ):
        absent = {"--model-source": tmp_path / "no-llava", "--text-source": tmp_path / "no-clip",
                  "--dino-source": tmp_path / "no-dino"}
        absent.update(dict(zip(given[::2], given[1::2])))
        started = time.perf_counter()
        with pytest.raises(SystemExit) as exit_info:
            main(["prepare", "--out", str(tmp_path / "out"), *LLAVA_SMALL_RUN,
                  *(item for option, path in absent.items() for item in (option, str(path)))])
        assert time.perf_counter() - started < 1.0
        assert exit_info.value.code == 1
        message = capsys.readouterr().err
        assert f"weights for {missing}" in message
        assert f"hf download {hub_id} --local-dir DIR" in message
        assert "--model-source DIR (LLaVA), --text-source DIR (CLIP), --dino-source DIR (DINOv2)" in message
    assert not (tmp_path / "out").exists()
