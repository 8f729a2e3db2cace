"""Seed 002's vision-edge findings are ruled on from the attack rows a vision-edge sweep writes."""

import pandas as pd
import pytest

from sims import results as R

CHANCE = 1 / 64


def attack_rows(sara_placed_shuffled: float, sara_ssim_shuffled: float, positionless_ssim: float) -> list[dict]:
    """One USL sweep's rows: per run (setting, policy) the attacks' SSIM and SARA's placement."""
    def row(setting, defenses, policy, attack, ssim, accuracy=0.9, placed=None, spread=None):
        return {"run": f"{setting}-{policy}", "sweep": "vision-edge", "paradigm": "usl", "profile": "mini-positional",
                "threat": "passive", "policy": policy, "defenses": defenses, "defense_setting": setting,
                "attack": attack, "base_attack": attack.split("_")[0], "ssim": ssim, "test_accuracy": accuracy,
                "position_accuracy": placed, "chance_position_accuracy": CHANCE, "without_positions_ssim": spread}

    rows = [row("none", "none", "off", "fora", 0.80), row("none", "none", "off", "sara", 0.75, placed=0.9, spread=0.7),
            row("shuffle", "shuffle", "off", "fora", 0.55),
            row("shuffle", "shuffle", "off", "sara_adaptive", sara_ssim_shuffled, placed=sara_placed_shuffled,
                spread=0.50)]
    for label, ssim, accuracy in (("k1", positionless_ssim + 0.05, 0.9), ("k2", positionless_ssim, 0.88),
                                  ("k2-adv", positionless_ssim - 0.05, 0.8)):
        setting = f"positionless(artifact={label})+shuffle"
        rows += [row(setting, "positionless+shuffle", "off", "sara_adaptive", ssim, accuracy, placed=CHANCE, spread=ssim),
                 row(setting, "positionless+shuffle", "off", "fora_adaptive", ssim - 0.02, accuracy)]
    rows += [row("none", "none", "dtp", "sara", 0.6, placed=0.4, spread=0.3),
             row("positionless(artifact=k2)", "positionless", "dtp", "sara_adaptive", 0.4, placed=CHANCE, spread=0.4)]
    return rows


def claims(**numbers) -> dict[str, str]:
    attacks = pd.DataFrame(attack_rows(**numbers))
    table = R.edge_claims(R.Results(pd.DataFrame(), pd.DataFrame(), attacks, pd.DataFrame()), "usl")
    return dict(zip(table["claim"], table["verdict"], strict=True))


def test_the_paper_s_findings_hold_when_the_numbers_say_so():
    verdicts = claims(sara_placed_shuffled=0.8, sara_ssim_shuffled=0.72, positionless_ssim=0.45)
    assert set(verdicts.values()) == {"holds"}, verdicts
    assert len(verdicts) == 6


@pytest.mark.parametrize("numbers, claim", [
    # SARA places the shuffled rows but wins back little of the SSIM: shuffling is not shown to be apparent privacy.
    ({"sara_placed_shuffled": 0.8, "sara_ssim_shuffled": 0.55, "positionless_ssim": 0.45}, "SARA restores most of it"),
    # The positionless edge leaves the attacker as good as on the undefended run.
    ({"sara_placed_shuffled": 0.8, "sara_ssim_shuffled": 0.72, "positionless_ssim": 0.75},
     "the positionless edge (k2) with shuffling keeps SSIM low"),
])
def test_a_finding_the_numbers_contradict_does_not_hold(numbers, claim):
    verdicts = claims(**numbers)
    chosen = [verdict for text, verdict in verdicts.items() if text.startswith(claim)]
    assert chosen == ["does not hold"], verdicts


def test_without_vision_edge_runs_the_claims_say_so():
    results = R.Results(pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), pd.DataFrame())
    table = R.edge_claims(results, "sl")
    assert list(table["verdict"]) == ["not testable"] and "no sl vision-edge runs" in table["reason"].iloc[0]
