"""Packed rows: first-fit decreasing against a plain scan of every pack, the layout of a packed
row (every token of every conversation once, boundaries, restarting positions) against a plain
one built token by token, and the offline collation against the online one."""

import random

import pytest
import torch
from conftest import fails_for_some_seed

from specheads.data import packing
from specheads.data.datasets import collate_packed
from specheads.data.features import FeatureRow, collate_features_packed
from specheads.errors import SpecHeadsError


def first_fit_plain(lengths, capacity):
    """First-fit decreasing, plainly: longest first (ties by index), each into the first pack with room."""
    packs, used = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for p, room in enumerate(used):
            if room + lengths[i] <= capacity:
                packs[p].append(i)
                used[p] += lengths[i]
                break
        else:
            packs.append([i])
            used.append(lengths[i])
    return packs


def random_lengths(seed):
    rng = random.Random(seed)
    capacity = rng.randint(8, 64)
    return [rng.randint(1, capacity) for _ in range(rng.randint(1, 60))], capacity


def check_packs(pack, seed):
    lengths, capacity = random_lengths(seed)
    packs = pack(lengths, capacity)
    assert packs == first_fit_plain(lengths, capacity)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))  # every row exactly once
    assert all(sum(lengths[i] for i in p) <= capacity for p in packs)


def next_fit(lengths, capacity):
    """A wrong variant: only the last pack opened is tried (next fit)."""
    packs, room = [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if packs and room >= lengths[i]:
            packs[-1].append(i)
            room -= lengths[i]
        else:
            packs.append([i])
            room = capacity - lengths[i]
    return packs


def test_packs_are_first_fit_decreasing():
    for seed in range(40):
        check_packs(packing.pack_rows, seed)
    assert fails_for_some_seed(check_packs, next_fit, range(40))
    assert packing.pack_rows([], 8) == []
    # deterministic: the same lengths pack the same (what a resumed run relies on)
    lengths, capacity = random_lengths(3)
    assert packing.pack_rows(lengths, capacity) == packing.pack_rows(list(lengths), capacity)


def test_packing_uses_fewer_rows_than_one_per_conversation():
    lengths, capacity = [5, 3, 8, 2, 2, 7, 1], 10
    packs = packing.pack_rows(lengths, capacity)
    assert packs == [[2, 3], [5, 1], [0, 4, 6]]
    assert packing.pack_lengths(lengths, packs) == [10, 10, 8]


def test_rows_longer_than_a_packed_row_are_refused():
    with pytest.raises(SpecHeadsError, match="do not fit a packed row of data.max_length=4"):
        packing.pack_rows([3, 5], 4)


def plain_layout(lengths, width):
    """document and position of every token, one token at a time."""
    document, position = [], []
    for d, n in enumerate(lengths):
        for p in range(n):
            document.append(d)
            position.append(p)
    pad = width - len(document)
    return document + [-1] * pad, position + list(range(pad))


def random_packs(seed):
    rng = random.Random(seed)
    rows = [
        {"input_ids": [rng.randint(3, 200) for _ in range(n)], "loss_mask": [rng.randint(0, 1) for _ in range(n)]}
        for n in (rng.randint(1, 9) for _ in range(rng.randint(2, 12)))
    ]
    capacity = max(len(r["input_ids"]) for r in rows) + rng.randint(0, 12)
    packs = packing.pack_rows([len(r["input_ids"]) for r in rows], capacity)
    return rows, packs, capacity


def check_collated(collate, seed):
    rows, packs, capacity = random_packs(seed)
    batch = collate([[rows[i] for i in p] for p in packs], pad_id=0)
    width = batch["input_ids"].shape[1]
    assert width <= capacity
    seen = []
    for b, pack in enumerate(packs):
        document, position = plain_layout([len(rows[i]["input_ids"]) for i in pack], width)
        assert batch["document"][b].tolist() == document
        assert batch["position_ids"][b].tolist() == position
        assert batch["attention_mask"][b].tolist() == [int(d >= 0) for d in document]
        for d, i in enumerate(pack):
            here = batch["document"][b] == d
            assert batch["input_ids"][b][here].tolist() == rows[i]["input_ids"]
            assert batch["loss_mask"][b][here].tolist() == rows[i]["loss_mask"]
            seen.append(i)
        assert not batch["loss_mask"][b][batch["document"][b] < 0].any()
    assert sorted(seen) == list(range(len(rows)))  # every token of every conversation, once


def positions_running_on(packs, pad_id):
    """A wrong variant: the packed row's positions run on across its conversations."""
    batch = collate_packed(packs, pad_id)
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]).clone()
    return batch


def one_document(packs, pad_id):
    """A wrong variant: the row is one document (boundaries lost)."""
    batch = collate_packed(packs, pad_id)
    batch["document"] = torch.where(batch["document"] >= 0, 0, -1)
    return batch


def offline(packs, pad_id):
    """The feature cache's packed collation, on rows whose 'states' are their token ids."""
    rows = [
        [
            FeatureRow(
                torch.tensor(r["input_ids"]),
                torch.tensor(r["loss_mask"]),
                {"final": torch.tensor(r["input_ids"], dtype=torch.float32)[:, None]},
            )
            for r in pack
        ]
        for pack in packs
    ]
    batch, states = collate_features_packed(rows, pad_id, torch.float32)
    real = batch["attention_mask"].bool()
    assert torch.equal(states["final"][..., 0][real], batch["input_ids"][real].float())  # states ride with tokens
    return batch


def test_packed_rows_hold_every_conversation_once_with_restarting_positions():
    for seed in range(30):
        check_collated(collate_packed, seed)
        check_collated(offline, seed)
    assert fails_for_some_seed(check_collated, positions_running_on, range(30))
    assert fails_for_some_seed(check_collated, one_document, range(30))
