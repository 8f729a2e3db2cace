"""A run's data, built once from its config: the one place that decides what each party reads.

    data = RunData.build(config)
    data.train_shard(partition), data.test_shard(partition)   # a client's samples
    data.tokenizer(bundle)                                    # the tokenizer every party reads text with
    data.mark_patches(profile)                                # stamped benchmark: the mark's patches per image
    data.auxiliary(limit)                                     # the attacker's public rows
    data.canary_members, data.canary_non_members             # the membership audit's canaries

The clients (clients/runtime.py), the attacks' ground truth (attacks/truth.py), what
the attacker knows (attacks/replay.py) and the FSHA hijack (strategies/adversarial.py)
all read a run's data from here, so a victim's sample and the truth it is scored
against cannot drift apart. A model without a tokenizer of its own reads the word
tokenizer of `vlm.mini.tokenizer.build_sample_tokenizer` over the run's samples — the
same rule the DTP preparation (pruning.prepare, a layer below) builds its tokenizer by.
"""

import random
from dataclasses import astuple, dataclass, replace
from functools import cached_property, lru_cache

from transformers import PreTrainedTokenizerBase

from config import ConfigError, SimConfig
from config.schema import DataConfig
from vlm.loading import ModelBundle
from vlm.mini.tokenizer import build_sample_tokenizer
from vlm.profiles import Profile
from vqa import (MarkRecord, UnknownQuestionKind, VQADataset, VQASample, is_stamped, load_vqa, mark_patches, mark_records,
                 partition_indices)


@dataclass(frozen=True)
class RunData:
    """The run's splits as the clients hold them, partitioned across `clients.count` clients.

    `train_indices[p]` / `test_indices[p]` index partition p's shard in `train_all` /
    `test_all`: training rows by the config's `data.partition`, test rows evenly (each
    client scores its own share with its own model). No image is in two shards.
    """

    data: DataConfig
    # The split the attacker's public rows come from (threat.aux_split).
    aux_split: str
    train_all: VQADataset
    test_all: VQADataset
    train_indices: tuple[tuple[int, ...], ...]
    test_indices: tuple[tuple[int, ...], ...]
    # data.canaries: rows of the training split no client held, each answered with a random
    # answer of its question kind, put in a client's shard by a fair coin (members, appended to
    # train_all) or left out (non-members).
    canary_members: tuple[VQASample, ...] = ()
    canary_non_members: tuple[VQASample, ...] = ()

    @classmethod
    def build(cls, config: SimConfig) -> "RunData":
        """The run's data; built once per process for each distinct data setting."""
        return _build(astuple(config.data), config.clients.count, config.threat.aux_split)

    def train_shard(self, partition: int) -> VQADataset:
        return self.train_all.select(self.train_indices[partition])

    def test_shard(self, partition: int) -> VQADataset:
        return self.test_all.select(self.test_indices[partition])

    @property
    def samples(self) -> list[VQASample]:
        """Every row the clients hold, training then test."""
        return [*self.train_all, *self.test_all]

    def tokenizer(self, bundle: ModelBundle) -> PreTrainedTokenizerBase:
        """The model's own tokenizer, or (a model without one) the word tokenizer over the run's samples."""
        if bundle.tokenizer is not None:
            return bundle.tokenizer
        tokenizer = self._word_tokenizer
        vocab_size = bundle.model.config.text_config.vocab_size
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"the data's word tokenizer has {len(tokenizer)} tokens, more than the {vocab_size} in the "
                f"vocabulary of profile {bundle.profile.name!r}: use fewer rows (data.train_limit, data.test_limit)"
            )
        return tokenizer

    @cached_property
    def _word_tokenizer(self) -> PreTrainedTokenizerBase:
        return build_sample_tokenizer(self.samples)

    @cached_property
    def marks(self) -> dict[str, MarkRecord]:
        """Stamped benchmark: the mark of every stamped image of the run's splits (empty otherwise)."""
        data = self.data
        if not is_stamped(data.dataset):
            return {}
        records: dict[str, MarkRecord] = {}
        for split in (data.train_split, data.test_split):
            records.update(mark_records(data.dataset, split, data.source or None))
        return records

    @cached_property
    def _mark_patches_by_grid(self) -> dict[tuple[int, int], dict[str, tuple[int, ...]]]:
        return {}

    def mark_patches(self, profile: Profile) -> dict[str, tuple[int, ...]]:
        """The patches holding each stamped image's mark at `profile`'s patch grid: worked out once
        per grid, since every client turn builds its runtime from them."""
        grid = (profile.image_size, profile.patch_size)
        if grid not in self._mark_patches_by_grid:
            self._mark_patches_by_grid[grid] = {image: mark_patches(record, *grid) for image, record in self.marks.items()}
        return self._mark_patches_by_grid[grid]

    def auxiliary(self, limit: int, seed: int = 1) -> list[VQASample]:
        """`limit` rows of the run's `threat.aux_split` whose images no client trains on or scores on:
        the public data the attacker has. `seed` is added to the data seed for their draw."""
        data, split = self.data, self.aux_split
        taken = {s.image_id for s in [*self.samples, *self.canary_non_members]}
        # Enough rows that `limit` remain after the clients' own rows of this split are left out.
        clients_rows = {data.train_split: self.train_all, data.test_split: self.test_all}.get(split, [])
        pool = load_vqa(data.dataset, split, data.source or None, limit=limit + len(clients_rows),
                        seed=data.seed + seed, question_kinds=data.kinds)
        aux = [s for s in pool if s.image_id not in taken][:limit]
        if not aux:
            raise ValueError(f"no auxiliary rows left in {data.dataset}/{split} outside the clients' data")
        return aux


# A few data settings per process: a sweep in one process moves from one to the next.
@lru_cache(maxsize=4)
def _build(data_fields: tuple, count: int, aux_split: str) -> RunData:
    data = DataConfig(*data_fields)
    source = data.source or None
    try:
        train_all = load_vqa(data.dataset, data.train_split, source, limit=data.train_limit or None, seed=data.seed,
                             question_kinds=data.kinds)
        test_all = load_vqa(data.dataset, data.test_split, source, limit=data.test_limit or None, seed=data.seed,
                            question_kinds=data.kinds)
    except UnknownQuestionKind as error:
        raise ConfigError("data.question_kinds", data.question_kinds,
                          f"kinds of {data.dataset}/{error.split}, comma-separated: {', '.join(error.present)}") from None
    try:
        train = partition_indices(train_all, count, method=data.partition, seed=data.seed, alpha=data.alpha)
        test = partition_indices(test_all, count, method="iid", seed=data.seed)
    except ValueError as error:
        raise ValueError(
            f"the run's data cannot be shared among clients.count={count} clients "
            f"(data.dataset={data.dataset!r}, data.train_limit={data.train_limit}, data.test_limit={data.test_limit}, "
            f"data.partition={data.partition!r}): {error}"
        ) from error
    train_indices, test_indices = tuple(map(tuple, train)), tuple(map(tuple, test))
    if not data.canaries:
        return RunData(data, aux_split, train_all, test_all, train_indices, test_indices)
    train_all, train_indices, members, non_members = _with_canaries(data, train_all, [*train_all, *test_all], train_indices)
    return RunData(data, aux_split, train_all, test_all, train_indices, test_indices, members, non_members)


def _with_canaries(data: DataConfig, train_all: VQADataset, held: list[VQASample], shards: tuple[tuple[int, ...], ...]
                   ) -> tuple[VQADataset, tuple[tuple[int, ...], ...], tuple[VQASample, ...], tuple[VQASample, ...]]:
    """`data.canaries` candidate canaries per client: rows of the training split outside `held`
    (the clients' rows and the test rows), each with an answer drawn from the other answers of
    its question kind. A fair coin per candidate puts it in its client's training data (appended
    to its shard) or leaves it out: Steinke et al.'s one-run audit needs exactly this, each
    canary included independently with probability 1/2 on top of a fixed dataset."""
    rng = random.Random(f"canaries:{data.seed}")
    answers_by_kind: dict[str, list[str]] = {}
    for sample in train_all:
        answers_by_kind.setdefault(sample.question_kind, [])
        if sample.answer not in answers_by_kind[sample.question_kind]:
            answers_by_kind[sample.question_kind].append(sample.answer)

    def canary(sample: VQASample) -> VQASample | None:
        others = [answer for answer in answers_by_kind.get(sample.question_kind, []) if answer != sample.answer]
        return replace(sample, answer=rng.choice(others), answers=()) if others else None

    taken = {s.image_id for s in held}
    wanted = data.canaries * len(shards)
    pool = load_vqa(data.dataset, data.train_split, data.source or None, limit=len(train_all) + 4 * wanted,
                    seed=data.seed + 2, question_kinds=data.kinds)
    candidates = [c for c in (canary(s) for s in pool if s.image_id not in taken) if c is not None][:wanted]
    if len(candidates) < wanted:
        raise ValueError(f"data.canaries={data.canaries}: only {len(candidates)} of the {wanted} canaries asked for can "
                         f"be drawn from {data.dataset}/{data.train_split} outside the clients' and the test rows")
    samples, grown = list(train_all), [list(shard) for shard in shards]
    members, non_members = [], []
    for index, candidate in enumerate(candidates):
        if rng.random() < 0.5:
            grown[index % len(shards)].append(len(samples))
            samples.append(candidate)
            members.append(candidate)
        else:
            non_members.append(candidate)
    dataset = VQADataset(train_all.name, train_all.split, samples)
    return dataset, tuple(map(tuple, grown)), tuple(members), tuple(non_members)
