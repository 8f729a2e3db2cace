"""The results tables read what the registered methods declare: a defense's strength option, an
attack's kind and headline metrics, a policy's budget, one colour per method."""

import sys
from pathlib import Path

from analysis import figures, runs, tables
from analysis.claims import vision_edge
from attacks.base import ATTACKS

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import sweep_results  # noqa: E402


def run_config(**values) -> dict:
    return {f"privacy.{key.replace('__', '.')}": value for key, value in values.items()}


def test_a_single_defense_run_lies_on_its_strength_option():
    assert runs.defense_series(run_config(defenses="noise", noise__variance=0.1)) == ("noise", 0.1)
    assert runs.defense_series(run_config(defenses="tome", tome__r=4)) == ("tome", 4.0)
    # PriPert's dial is the variant's: sparsity for l0, budget for l2.
    assert runs.defense_series(run_config(defenses="pripert", pripert__sparsity=0.3)) == ("pripert", 0.3)
    assert runs.defense_series(run_config(defenses="pripert", pripert__variant="l2", pripert__budget=0.2)) == (
        "pripert(variant=l2)", 0.2)
    # A defense without a dial, or two defenses, is a setting of its own.
    assert runs.defense_series(run_config(defenses="shuffle")) == ("shuffle", None)
    assert runs.defense_series(run_config(defenses="noise,sparsify", noise__variance=0.01, sparsify__ratio=0.5)) == (
        "noise(variance=0.01)+sparsify(ratio=0.5)", None)


def test_a_policy_with_a_budget_is_labelled_with_it():
    assert runs.policy_label({"pruning.policy": "fixed", "pruning.ratio": 0.5}) == "fixed-0.5"
    assert runs.policy_label({"pruning.policy": "dtp", "pruning.ratio": 0.0}) == "dtp"
    assert runs.policy_label({"pruning.policy": "dtp", "pruning.alpha": 1.0}) == "dtp"
    assert runs.policy_label({"pruning.policy": "dtp", "pruning.alpha": 0.5}) == "dtp-a0.5"
    assert runs.policy_label({"pruning.policy": "fixed", "pruning.ratio": 0.5, "pruning.alpha": 0.0}) == "fixed-0.5"
    assert runs.policy_label({}) == "off"


def test_attack_groups_and_colours_come_from_the_registry():
    assert {"fora", "fsha", "sara"} <= set(tables.IMAGE_ATTACKS) and {"fora", "sara"} <= set(vision_edge.EDGE_ATTACKS)
    assert "fsha" not in vision_edge.EDGE_ATTACKS and {"mia", "mia_loss", "mtv_mia"} <= set(tables.MEMBERSHIP_ATTACKS)
    assert {"drop", "positionless", "shuffle", "tome"} <= set(tables.EDGE_DEFENSES) and "noise" not in tables.EDGE_DEFENSES
    assert list(figures.ATTACK_COLORS) == ATTACKS.names()
    assert len(set(figures.ATTACK_COLORS.values())) == len(figures.ATTACK_COLORS)
    # Every defense has a colour of its own, so small multiples never repeat one.
    assert len(set(figures.DEFENSE_COLORS.values())) == len(figures.DEFENSE_COLORS)
    assert list(figures.PARADIGM_COLORS) == ["cl", "fl", "sl", "usl"]


def test_a_label_names_the_attack_it_replays():
    labels = ("fora", "fora_adaptive", "mia_loss", "mia_loss_canaries", "mean_image")
    assert [tables.label_attack(label) for label in labels] == ["fora", "fora", "mia_loss", "mia_loss", None]


def test_the_vision_edge_table_has_a_column_per_image_attack_label():
    rows = [{"mean_image_ssim": 0.7, "sara_ssim": 0.5, "sara_adaptive_ssim": 0.6, "fora_ssim": 0.4, "fsha_ssim": None}]
    assert sweep_results.edge_columns(rows) == [
        ("fora", "FORA", ("ssim", "psnr", "fsim", "mark_readback")),
        ("sara", "SARA", ("ssim", "psnr", "fsim", "position_accuracy")),
        ("sara_adaptive", "adaptive SARA", ("ssim", "psnr", "fsim", "position_accuracy"))]
