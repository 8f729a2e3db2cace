"""One builder of a run's data: what the clients hold is what the attacks' truth scores against."""

import re

import pytest

from attacks.truth import RunTruth
from clients.runtime import build_runtime
from config import ConfigError, load_config
from training.data import RunData
from vlm.loading import ModelBundle, build_random_model, clip_image_preprocessor
from vlm.mini.tokenizer import build_sample_tokenizer
from vlm.profiles import TINY
from vqa import load_vqa, mark_patches, mark_records, partition_indices


def tiny_config(tmp_path, **overrides):
    return load_config({
        "paradigm": "usl", "model.profile": "tiny", "data.dataset": "easyvqa-stamped", "data.train_limit": 40,
        "data.test_limit": 12, "data.partition": "dirichlet", "data.alpha": 1.0, "data.seed": 3, "clients.count": 2,
        "output.root": str(tmp_path), "output.name": "run", **overrides,
    })


def test_the_shards_are_the_seeded_rows_partitioned_by_the_configs_method(tmp_path):
    config = tiny_config(tmp_path)
    data = RunData.build(config)
    train = load_vqa("easyvqa-stamped", "train", limit=40, seed=3)
    test = load_vqa("easyvqa-stamped", "test", limit=12, seed=3)
    assert [s.id for s in data.train_all] == [s.id for s in train]
    assert [s.id for s in data.test_all] == [s.id for s in test]
    assert [list(i) for i in data.train_indices] == partition_indices(train, 2, method="dirichlet", seed=3, alpha=1.0)
    assert [list(i) for i in data.test_indices] == partition_indices(test, 2, method="iid", seed=3)
    assert [s.id for s in data.train_shard(1)] == [train[i].id for i in data.train_indices[1]]
    # Built once per process: a config differing only outside the data shares it.
    assert RunData.build(tiny_config(tmp_path, **{"train.lr": 0.5})) is data
    assert RunData.build(tiny_config(tmp_path, **{"data.seed": 4})) is not data


def test_a_client_runtime_and_the_run_truth_read_the_builders_data(tmp_path):
    config = tiny_config(tmp_path)
    data = RunData.build(config)
    truth = RunTruth(config)
    for partition in range(2):
        runtime = build_runtime(config, partition, tmp_path / f"client-{partition}")
        assert [item.sample.id for item in runtime.train] == [s.id for s in data.train_shard(partition)]
        assert [item.sample.id for item in runtime.test] == [s.id for s in data.test_shard(partition)]
        assert [s.id for s in truth.shards[partition]] == [s.id for s in data.train_shard(partition)]
        # The tiny model has no tokenizer: every party reads the word tokenizer over the run's samples.
        assert runtime.tokenizer.get_vocab() == build_sample_tokenizer(data.samples).get_vocab()
        assert runtime.marks == data.mark_patches(TINY)
    records = {**mark_records("easyvqa-stamped", "train"), **mark_records("easyvqa-stamped", "test")}
    assert data.marks == records
    assert data.mark_patches(TINY) == {
        image: mark_patches(record, TINY.image_size, TINY.patch_size) for image, record in records.items()
    }
    assert all(truth.mark(s) == records.get(s.image_id) for s in data.samples)


@pytest.mark.parametrize("aux_split", ["test", "train"])
def test_the_attackers_public_rows_share_no_image_with_the_clients(tmp_path, aux_split):
    data = RunData.build(tiny_config(tmp_path, **{"threat.aux_split": aux_split}))
    aux = data.auxiliary(30)
    assert len(aux) == 30 and len({s.id for s in aux}) == 30
    assert not {s.image_id for s in aux} & {s.image_id for s in data.samples}
    assert {s.split for s in aux} == {aux_split}
    assert [s.id for s in data.auxiliary(30)] == [s.id for s in aux]
    assert [s.id for s in data.auxiliary(30, seed=2)] != [s.id for s in aux]


def test_too_few_rows_for_the_clients_are_refused_before_any_data_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"data.train_limit=1 .*at least clients.count=2 rows"):
        tiny_config(tmp_path, **{"data.train_limit": 1, "data.partition": "iid"})
    with pytest.raises(ConfigError, match=r"data.test_limit=1 .*at least clients.count=2 rows"):
        tiny_config(tmp_path, **{"data.test_limit": 1})


def test_a_word_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    data = RunData.build(tiny_config(tmp_path))
    small = build_random_model(TINY, vocab_size=8, image_token_id=4, pad_token_id=0)
    bundle = ModelBundle(small, TINY, None, clip_image_preprocessor(TINY.image_size))
    too_many = r"tokenizer has \d+ tokens, more than the 8 in the vocabulary of profile 'tiny'"
    with pytest.raises(ValueError, match=too_many):
        data.tokenizer(bundle)


def test_question_kinds_draw_every_row_of_the_run_from_those_kinds_only(tmp_path):
    kinds = {"shape", "color"}
    config = tiny_config(tmp_path, **{"data.question_kinds": "shape, color", "data.canaries": 6,
                                      "threat.aux_split": "train"})
    data = RunData.build(config)
    rows = [*data.train_all, *data.test_all, *data.canary_non_members, *data.auxiliary(20)]
    assert {s.question_kind for s in rows} == kinds
    # The limit draws from the kinds' rows: as many rows as without the filter.
    assert (len(data.train_all) - len(data.canary_members), len(data.test_all)) == (40, 12)
    assert [s.id for s in data.test_all] == [s.id for s in load_vqa("easyvqa-stamped", "test", limit=12, seed=3,
                                                                     question_kinds=("shape", "color"))]


@pytest.mark.parametrize(("kinds", "allowed"), [
    ("shape,,color", "distinct question kinds separated by commas"),
    ("shape,shape", "distinct question kinds separated by commas"),
    ("shape,size", "kinds of easyvqa-stamped/train, comma-separated: color, shape, yes/no"),
])
def test_question_kinds_that_name_no_kind_of_the_dataset_are_refused_naming_the_key(tmp_path, kinds, allowed):
    with pytest.raises(ConfigError, match=r"data.question_kinds=" + re.escape(repr(kinds))) as refused:
        RunData.build(tiny_config(tmp_path, **{"data.question_kinds": kinds}))
    assert allowed in str(refused.value)
