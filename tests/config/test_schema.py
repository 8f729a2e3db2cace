"""The run-config schema: every wrong value gets one message naming key, value and what is allowed."""

from pathlib import Path

import pytest

from sims.launch import app_config, parse_overrides
from config import ConfigError, load_config


def test_the_paper_sim_holds_the_paper_settings():
    config = load_config(app_config(Path(__file__).parents[2] / "sims" / "usl_vqarad"))
    assert (config.paradigm, config.model.profile, config.data.dataset) == ("usl", "llava-1.5-7b", "vqa-rad")
    assert config.cuts == (8, 24) and config.model.lora_rank == 32


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        ({"paradigm": "xl"}, "paradigm", "cl, fl, sl, usl"),
        ({"model.profile": "llava-2"}, "model.profile", "llava-1.5-7b"),
        ({"model.profile": "tiny", "split.cut_a": 3, "split.cut_b": 2}, "split.cut_a", "[1, 2]"),
        ({"model.profile": "tiny", "split.cut_a": 2, "split.cut_b": 2}, "split.cut_b", "[3, 3]"),
        ({"model.profile": "tiny", "split.sl_cut": 4}, "split.sl_cut", "[1, 3]"),
        ({"data.dataset": "mnist"}, "data.dataset", "easyvqa"),
        ({"wire.dtype": "int8"}, "wire.dtype", "bf16, fp16, fp32"),
        ({"pruning.policy": "fastest"}, "pruning.policy", "off, fixed, dtp, oracle"),
        ({"pruning.policy": "dtp"}, "pruning.artifacts", "the folder holding dtp.pt"),
        ({"pruning.policy": "oracle"}, "pruning.artifacts", "the folder holding oracle.pt"),
        ({"pruning.policy": "dtp", "pruning.artifacts": "/nowhere"}, "pruning.artifacts", "qpriv-prune prepare"),
        ({"pruning.policy": "fixed", "pruning.ratio": 1.0}, "pruning.ratio", "[0, 1)"),
        ({"pruning.ratio": 0.5}, "pruning.ratio", "0 unless pruning.policy is one of: fixed, "),
        ({"pruning.policy": "random", "pruning.pivots": 2}, "pruning.pivots", "4 unless pruning.policy is one of: dart"),
        ({"pruning.policy": "dart", "pruning.pivots": 0}, "pruning.pivots", "≥ 1"),
        ({"pruning.alpha": -1.0}, "pruning.alpha", ">= 0"),
        ({"pruning.alpha": 0.0, "pruning.beta": 0.0}, "pruning.beta", "> 0 when pruning.alpha=0"),
        ({"model.profile": "mini", "pruning.text_source": "/clip"}, "pruning.text_source", "builds its own seeded encoders"),
        ({"clients.count": 0}, "clients.count", ">= 1"),
        ({"paradigm": "cl", "clients.count": 2}, "clients.count", "1 for paradigm cl"),
        ({"clients.fraction_train": 1.5}, "clients.fraction_train", "(0, 1]"),
        ({"train.rounds": "many"}, "train.rounds", "type"),
        ({"train.lr": 0.0}, "train.lr", "> 0"),
        ({"trian.rounds": 3}, "trian.rounds", "train.rounds"),
        ({"threat.model": "malicious"}, "threat.model", "none, passive, active-fsha"),
        ({"paradigm": "cl", "clients.count": 1, "threat.model": "passive"}, "threat.model", "of paradigm cl: none"),
        ({"paradigm": "fl", "threat.model": "active-fsha"}, "threat.model", "of paradigm fl: none, passive"),
        ({"threat.max_bytes": -1}, "threat.max_bytes", ">= 0"),
        ({"threat.record_rounds": "1,last"}, "threat.record_rounds", "round numbers >= 1"),
        ({"threat.record_rounds": "0,5"}, "threat.record_rounds", "round numbers >= 1"),
        ({"threat.aux_split": "validation"}, "threat.aux_split", "train, test"),
        ({"threat.fsha_pretrain_steps": 0}, "threat.fsha_pretrain_steps", ">= 1"),
        ({"threat.model": "active-fsha", "data.test_limit": 0}, "data.test_limit", "public data is the rest"),
        ({"threat.model": "active-fsha", "threat.aux_split": "train"}, "data.train_limit", "threat.aux_split"),
        ({"threat.update_canaries": -1}, "threat.update_canaries", ">= 0"),
        ({"threat.update_canaries": 100}, "threat.update_canaries", "0 for paradigm usl"),
        ({"paradigm": "fl", "threat.update_canaries": 1}, "threat.update_canaries", ">= 2"),
        ({"paradigm": "fl", "threat.update_canaries": 100, "privacy.dp.mode": "local", "privacy.dp.noise_multiplier": 1.0},
         "threat.update_canaries", "audit the modes off, central, central-client-clipping"),
        ({"paradigm": "fl", "clients.count": 3, "threat.update_canaries": 100, "privacy.secagg.enabled": True},
         "threat.update_canaries", "SecAgg+ node"),
    ],
)
def test_a_wrong_value_names_key_value_and_allowed(overrides, key, allowed):
    with pytest.raises(ConfigError) as caught:
        load_config({"output.name": "x", **overrides})
    assert caught.value.key == key
    assert f"{key}=" in str(caught.value) and allowed in str(caught.value)


def test_defaults_fill_the_profile_cuts():
    config = load_config({"output.name": "x", "model.profile": "mini", "paradigm": "sl"})
    assert config.cuts == (4,) and load_config({"output.name": "x", "model.profile": "mini"}).cuts == (2, 6)


def test_overrides_parse_as_flwr_reads_them():
    assert parse_overrides('train.rounds=5 model.source="/data/llava" output.resume=false') == {
        "train.rounds": 5, "model.source": "/data/llava", "output.resume": False
    }


def test_the_recorded_rounds_are_round_numbers_or_every_round():
    assert load_config({"output.name": "r", "threat.record_rounds": " 10, 1,10 "}).recorded_rounds == (1, 10)
    assert load_config({"output.name": "r"}).recorded_rounds is None
