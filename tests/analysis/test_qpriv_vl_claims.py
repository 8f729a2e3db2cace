"""QPriv-VL's claims and the three questions the paper did not ask, judged on a pruning sweep's runs
at three seeds: each verdict class where the numbers put it, membership read from the sweep that
holds it, and another sweep's runs of the same setting never mixed in."""

import numpy as np
import pandas as pd

from analysis.claims import qpriv_vl
from analysis.runs import Results

QUESTIONS = 2000
# policy -> (kept tokens, accuracy, MIA success, FORA PSNR over the mean image's 15 dB, cut-probe read-back
# told the policy, and assuming random keep sets)
POLICIES = {"off": (64, 0.80, 0.95, 15.2, 0.60, 0.60), "fixed-0.3": (45, 0.79, 0.93, 15.1, 0.50, 0.30),
            "fixed-0.6": (26, 0.79, 0.90, 15.0, 0.45, 0.25), "dtp": (40, 0.78, 0.70, 15.1, 0.20, 0.15),
            "dtp-a0": (40, 0.81, 0.70, 15.1, 0.20, 0.15), "random-0.4": (38, 0.70, 0.90, 15.0, 0.50, 0.30)}
CHANCE = 0.15


def sweep(name: str = "pruning-attacks", policies: dict = POLICIES) -> Results:
    rng = np.random.default_rng(0)
    runs, attacks, outcomes = [], [], []
    for seed in range(3):
        for policy, (kept, accuracy, mia, psnr, told, untold) in policies.items():
            run = f"{name}-{policy}-s{seed}"
            settings = {"run": run, "sweep": name, "seed": seed, "paradigm": "usl", "policy": policy,
                        "policy_name": policy.split("-")[0], "threat": "passive",
                        "hijacked": False, "defenses": "none", "privacy_setting": "none", "kept_tokens_mean": kept}
            scores = (rng.random(QUESTIONS) < accuracy).astype(float)
            runs.append({**settings, "state": "finished", "test_accuracy": scores.mean(), "kept_tokens_share": kept / 64,
                         "exclusion_ratio": 1.3 + 0.05 * seed if policy == "dtp" else None})
            outcomes += [{**settings, "item": f"q{i}", "score": score} for i, score in enumerate(scores)]
            attacks += [{**settings, "attack": "mia", "base_attack": "mia", "attack_success": mia + 0.01 * seed},
                        *({**settings, "attack": label, "base_attack": "fora", "psnr": psnr + 0.02 * seed - lower,
                           "baseline_psnr": 15.0} for label, lower in (("fora", 0.0), ("fora_unaware", 0.1))),
                        *({**settings, "attack": label, "base_attack": "cut_probe", "mark_readback": value + 0.01 * seed,
                           "mark_readback_chance": CHANCE}
                          for label, value in (("cut_probe", told), ("cut_probe_unaware", untold))),
                        *({**settings, "attack": label, "base_attack": "actinv", "token_recall": 0.5 + 0.01 * seed}
                          for label in ("actinv", "actinv-r3"))]
    return Results(pd.DataFrame(runs), pd.DataFrame(), pd.DataFrame(attacks), pd.DataFrame(outcomes), pd.DataFrame())


def verdicts(results: Results) -> dict[str, str]:
    table = qpriv_vl.claims(results)
    return dict(zip(table["claim"], table["verdict"], strict=True))


def test_each_claim_gets_the_verdict_its_numbers_give():
    found = verdicts(sweep())
    assert found["MIA attack success with DTP"] == "holds"
    assert found["MIA attack success, undefended (VQA-RAD)"] == "holds"
    assert found["sensitivity exclusion ratio of DTP above 1"] == "holds"
    # fixed-0.6 keeps 41% of the tokens, the paper's budget: within 5 points of unpruned.
    assert found["competitive accuracy at about 40% of the token budget"] == "holds"
    # DTP is 1 point below the fixed ratio keeping fewer tokens: the interval straddles the 1-point margin.
    assert found["DTP matches or beats fixed ratios while keeping more tokens"] == "inconclusive"
    # Every pruned point's FORA sits at the mean image: nothing to be below a trend of.
    assert found["FORA PSNR of DTP below the fixed ratios' linear trend"] == "not testable"
    # α = 0 answers 3 points better on 2,000 questions a seed.
    assert found["α sweep: α = 0 (sensitivity only) answers better than α = 1"] == "holds"
    # At DTP's budget (40 tokens: random-0.4's 38 the nearest) DTP's probe reads 30 points less,
    # and answers 8 points better; no other efficiency pruner ran.
    assert found["DTP leaks less than random at equal tokens (cut-probe read-back)"] == "holds"
    assert found["DTP answers as well as random at equal tokens"] == "holds"
    assert found["DTP leaks less than fastv at equal tokens"] == "not testable"
    # Told the policy, the probe reads 5-20 points more on every pruned policy.
    assert found["an attacker told the policy reads more (cut probe mark_readback)"] == "holds"
    # Told, FORA gains 0.1 dB, but neither attacker leaves the mean image's PSNR (within 1 dB).
    table = qpriv_vl.claims(sweep()).set_index("claim")
    assert table.loc["an attacker told the policy reads more (FORA psnr)", "verdict"] == "not testable"
    assert "floor" in table.loc["an attacker told the policy reads more (FORA psnr)", "reason"]
    # ActInv recovers as much at round 3 as at round 1: the difference is 0 exactly.
    assert found["leakage grows over training, unpruned (ActInv token_recall, round 3 − round 1)"] == "inconclusive"


def test_membership_is_read_from_the_sweep_that_holds_it():
    one = sweep()
    memorisation = sweep("pruning-mia")
    mia = memorisation.attacks[memorisation.attacks["attack"] == "mia"].assign(attack="mia_loss", base_attack="mia_loss")
    mia["auc"] = mia["attack_success"]
    mia.loc[mia["policy"] == "dtp", "auc"] = 0.94
    attacks = pd.concat([one.attacks[one.attacks["attack"] != "mia"], mia], ignore_index=True)
    table = qpriv_vl.claims(Results(one.runs, one.rounds, attacks, one.outcomes, one.incomplete)).set_index("claim")
    # DTP's AUC 0.94 against the unpruned 0.95-0.97: no drop of 0.05, read from pruning-mia's runs.
    assert table.loc["MIA attack success with DTP", "verdict"] == "does not hold"
    assert table.loc["MIA attack success with DTP", "measured"] == "DTP − unpruned auc"


def test_another_sweeps_runs_of_the_same_setting_are_not_mixed_in():
    one, other = sweep(), sweep("another")
    both = Results(*(pd.concat([a, b], ignore_index=True) for a, b in
                     zip((one.runs, one.rounds, one.attacks, one.outcomes, one.incomplete),
                         (other.runs, other.rounds, other.attacks, other.outcomes, other.incomplete), strict=True)))
    assert verdicts(both) == verdicts(one)


def test_at_a_quarter_of_the_tokens_the_fixed_ratio_is_held_against_the_pruners_that_ran_there():
    # fixed-0.75 (QPriv-VL's ranking at 16 tokens) against fastv-0.75: fastv reads 25 points more; both
    # answer 78%, so the accuracy interval straddles the 1-point margin; random ran only at DTP's
    # budget (38 tokens), too far from 16 to be compared.
    found = verdicts(sweep(policies={**POLICIES, "fixed-0.75": (16, 0.78, 0.8, 15.0, 0.20, 0.15),
                                     "fastv-0.75": (16, 0.78, 0.8, 15.0, 0.45, 0.30)}))
    quarter = "QPriv-VL's ranking (fixed-0.75)"
    assert found[f"{quarter} leaks less than fastv at 25% of the tokens (cut-probe read-back)"] == "holds"
    assert found[f"{quarter} answers as well as fastv at 25% of the tokens"] == "inconclusive"
    assert found[f"{quarter} leaks less than random at 25% of the tokens"] == "not testable"
    # The DTP rows compare at DTP's own budget still: fastv ran at 16 tokens only, not near DTP's 40.
    assert found["DTP leaks less than fastv at equal tokens"] == "not testable"
