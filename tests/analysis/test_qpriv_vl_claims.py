"""QPriv-VL's claims judged on a pruning sweep's runs at three seeds: each verdict class where the
numbers put it, and another sweep's runs of the same setting never mixed in."""

import numpy as np
import pandas as pd

from analysis.claims import qpriv_vl
from analysis.runs import Results

QUESTIONS = 2000
# policy -> (kept tokens, accuracy, MIA success, FORA PSNR over the mean image's 15 dB)
POLICIES = {"off": (64, 0.80, 0.95, 15.2), "fixed-0.3": (45, 0.79, 0.93, 15.1), "fixed-0.6": (26, 0.79, 0.90, 15.0),
            "dtp": (40, 0.78, 0.70, 15.1)}


def sweep(name: str = "pruning-attacks") -> Results:
    rng = np.random.default_rng(0)
    runs, attacks, outcomes = [], [], []
    for seed in range(3):
        for policy, (kept, accuracy, mia, psnr) in POLICIES.items():
            run = f"{name}-{policy}-s{seed}"
            settings = {"run": run, "sweep": name, "seed": seed, "paradigm": "usl", "policy": policy, "threat": "passive",
                        "hijacked": False, "defenses": "none", "privacy_setting": "none", "kept_tokens_mean": kept}
            scores = (rng.random(QUESTIONS) < accuracy).astype(float)
            runs.append({**settings, "state": "finished", "test_accuracy": scores.mean(), "kept_tokens_share": kept / 64,
                         "exclusion_ratio": 1.3 + 0.05 * seed if policy == "dtp" else None})
            outcomes += [{**settings, "item": f"q{i}", "score": score} for i, score in enumerate(scores)]
            attacks += [{**settings, "attack": "mia", "base_attack": "mia", "attack_success": mia + 0.01 * seed},
                        {**settings, "attack": "fora", "base_attack": "fora", "psnr": psnr + 0.02 * seed,
                         "baseline_psnr": 15.0}]
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
    assert found["α sweep: accuracy 0.566 (α=0) vs 0.527 (α=1) on VQA-RAD"] == "not testable"


def test_another_sweeps_runs_of_the_same_setting_are_not_mixed_in():
    one, other = sweep(), sweep("another")
    both = Results(*(pd.concat([a, b], ignore_index=True) for a, b in
                     zip((one.runs, one.rounds, one.attacks, one.outcomes, one.incomplete),
                         (other.runs, other.rounds, other.attacks, other.outcomes, other.incomplete), strict=True)))
    assert verdicts(both) == verdicts(one)
