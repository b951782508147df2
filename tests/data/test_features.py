import pytest
import torch
from conftest import assert_same_numbers

from specheads.data.features import (
    FeatureCache,
    collate_features,
    feature_cache_key,
    shard_plan,
    write_features,
)
from specheads.errors import SpecHeadsError

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 12 + 3 * i
        ids = torch.randint(0, 256, (t,), generator=g)
        mask = torch.zeros(t, dtype=torch.long)
        mask[t // 2 :] = 1
        out.append({"input_ids": ids.tolist(), "loss_mask": mask.tolist()})
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_features_equal_online_bit_for_bit(tiny_target, tmp_path, dtype):
    data = rows()
    layers = [1, 3, 6]
    # small shards so that rows span several files
    index = write_features(
        tiny_target, data, layers, True, tmp_path / "feat", max_length=64, dtype=dtype, shard_tokens=40
    )
    assert len(index["shards"]) > 1 and index["rows"] == len(data)
    cache = FeatureCache(tmp_path / "feat", feature_cache_key(tiny_target, layers, True, 64))
    assert len(cache) == len(data)
    want = getattr(torch, dtype)
    for i, row in enumerate(data):
        ids = torch.tensor(row["input_ids"])
        online = tiny_target.states(ids.unsqueeze(0), layer_ids=layers, final=True)
        cached = cache[i]
        assert torch.equal(cached.input_ids, ids)
        assert cached.loss_mask.tolist() == row["loss_mask"]
        for k in layers:
            assert torch.equal(cached.states[k], online.hidden[k][0].to(want))
        assert torch.equal(cached.states["final"], online.final[0].to(want))


def sequential_shards(lengths, shard_tokens):
    """The plain rule: fill a shard row by row, close it once it holds shard_tokens tokens."""
    shards, current, tokens = [], [], 0
    for r, n in enumerate(lengths):
        current.append(r)
        tokens += n
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    return shards + ([current] if current else [])


@pytest.mark.parametrize("shard_tokens", [1, 7, 40, 10_000])
def test_shard_plan_is_the_sequential_rule(shard_tokens):
    lengths = torch.randint(1, 30, (23,), generator=torch.Generator().manual_seed(shard_tokens)).tolist()
    plan = shard_plan(lengths, shard_tokens)
    assert [list(r) for r in plan] == sequential_shards(lengths, shard_tokens)
    assert [list(r) for r in shard_plan(lengths, shard_tokens)] != sequential_shards(lengths[1:], shard_tokens)
    assert shard_plan([], shard_tokens) == []


def failing_after(target, monkeypatch, forwards, error="out of memory"):
    """The target's states fail on forward number `forwards` (counted from 1); returns the count."""
    calls = []
    real = target.states

    def states(*args, **kwargs):
        calls.append(1)
        if len(calls) == forwards:
            raise RuntimeError(error)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "states", states)
    return calls


def tree_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_interrupted_pass_keeps_whole_shards_and_resumes_to_the_same_cache(tiny_target, tmp_path, monkeypatch):
    data = rows(8)
    args = dict(max_length=64, dtype="float32", shard_tokens=40, extra={"data": "abc"})
    write_features(tiny_target, data, [2], True, tmp_path / "whole" / "feat", **args)
    want = tree_bytes(tmp_path / "whole" / "feat")
    plan = shard_plan([len(r["input_ids"]) for r in data], 40)
    assert len(plan) >= 4
    # dies on the first row of the third shard: two whole shards, nothing of the third
    third = plan[2].start + 1
    calls = failing_after(tiny_target, monkeypatch, third)
    with pytest.raises(RuntimeError, match="out of memory"):
        write_features(tiny_target, data, [2], True, tmp_path / "run" / "feat", **args)
    assert len(calls) == third
    assert not (tmp_path / "run" / "feat").exists()
    partial = tmp_path / "run" / ".feat.partial"
    assert sorted(p.name for p in partial.iterdir()) == [
        "plan.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    monkeypatch.undo()
    (partial / ".shard-00002.safetensors.x1.tmp.safetensors").write_bytes(b"half")  # a kill inside save_file
    # the rerun computes only the missing shards' rows and ends with the uninterrupted cache
    calls = failing_after(tiny_target, monkeypatch, 10_000)
    write_features(tiny_target, data, [2], True, tmp_path / "run" / "feat", **args)
    assert len(calls) == len(data) - plan[2].start
    assert tree_bytes(tmp_path / "run" / "feat") == want
    assert list((tmp_path / "run").iterdir()) == [tmp_path / "run" / "feat"]


def test_an_unfinished_pass_over_other_rows_starts_over(tiny_target, tmp_path, monkeypatch):
    calls = failing_after(tiny_target, monkeypatch, 3)
    with pytest.raises(RuntimeError):
        write_features(tiny_target, rows(6), [2], True, tmp_path / "feat", max_length=64, shard_tokens=20)
    monkeypatch.undo()
    other = rows(6, seed=1)  # the same lengths, other tokens: the kept shards do not belong to it
    calls = failing_after(tiny_target, monkeypatch, 10_000)
    write_features(tiny_target, other, [2], True, tmp_path / "feat", max_length=64, shard_tokens=20)
    assert len(calls) == len(other)
    cache = FeatureCache(tmp_path / "feat")
    assert [cache[i].input_ids.tolist() for i in range(len(other))] == [r["input_ids"] for r in other]


def test_a_cache_the_disk_cannot_hold_is_refused_before_the_pass(tiny_target, tmp_path, monkeypatch):
    import shutil

    from specheads.data import features

    real = shutil.disk_usage
    monkeypatch.setattr(features.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    calls = failing_after(tiny_target, monkeypatch, 10_000)
    with pytest.raises(SpecHeadsError, match=r"needs 0\.0 GB for 90 tokens .* has 0\.0 GB free") as err:
        write_features(tiny_target, rows(5), [2], True, tmp_path / "feat", max_length=64, dtype="float32")
    assert "\n" not in str(err.value) and calls == []
    assert not (tmp_path / "feat").exists()
    monkeypatch.setattr(features.shutil, "disk_usage", real)
    write_features(tiny_target, rows(5), [2], True, tmp_path / "feat", max_length=64, dtype="float32")


def test_stale_cache_is_refused(tiny_target, tmp_path):
    write_features(tiny_target, rows(2), [2], False, tmp_path / "feat", max_length=64, dtype="float32")
    with pytest.raises(SpecHeadsError, match="stale feature cache .*layer_ids"):
        FeatureCache(tmp_path / "feat", feature_cache_key(tiny_target, [3], False, 64))
    with pytest.raises(SpecHeadsError, match="max_length"):
        FeatureCache(tmp_path / "feat", feature_cache_key(tiny_target, [2], False, 128))
    with pytest.raises(SpecHeadsError, match="not a feature cache"):
        FeatureCache(tmp_path / "nothing")


def test_collate_pads_like_online(tiny_target, tmp_path):
    data = rows(3)
    write_features(tiny_target, data, [2], True, tmp_path / "feat", max_length=64, dtype="float32")
    cache = FeatureCache(tmp_path / "feat")
    batch, states = collate_features([cache[0], cache[2]], pad_id=0, dtype=torch.float32)
    assert batch["input_ids"].shape == (2, len(data[2]["input_ids"]))
    assert batch["attention_mask"][0].sum() == len(data[0]["input_ids"])
    assert states[2].shape[:2] == batch["input_ids"].shape
    assert torch.equal(states["final"][1], cache[2].states["final"])


def test_offline_source_gives_online_losses(tiny_target, tmp_path):
    from specheads.config.train import HeadConfig
    from specheads.data.features import ensure_split_features
    from specheads.heads import build_head
    from specheads.train.state_source import OfflineStates, OnlineStates

    splits = {"train": rows(6), "eval": rows(2, seed=1)}
    ensure_split_features(
        tiny_target, splits, [2, 3, 4], True, tmp_path / "feat", max_length=64, dtype="float32", data_fingerprint="abc"
    )
    stamp = (tmp_path / "feat" / "train" / "index.json").stat().st_mtime_ns
    # an up-to-date cache is reused, not rewritten
    ensure_split_features(
        tiny_target, splits, [2, 3, 4], True, tmp_path / "feat", max_length=64, dtype="float32", data_fingerprint="abc"
    )
    assert (tmp_path / "feat" / "train" / "index.json").stat().st_mtime_ns == stamp
    offline = OfflineStates(tmp_path / "feat", tiny_target, 64, 0, torch.device("cpu"), torch.float32)
    online = OnlineStates(tiny_target, splits, 0)
    torch.manual_seed(0)
    head = build_head(
        HeadConfig(family="eagle3", layer_ids=[2, 3, 4], draft_vocab_size=96, ttt_steps=3),
        tiny_target,
        train_rows=splits["train"],
    )
    for source in (offline, online):
        source.require(*head.training_states())
    assert offline.rows("train") == [
        {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in splits["train"]
    ]
    for idx in ([0, 3], [5, 1, 2]):
        (b1, s1), (b2, s2) = offline.fetch("train", idx), online.fetch("train", idx)
        assert torch.equal(b1["input_ids"], b2["input_ids"]) and torch.equal(b1["loss_mask"], b2["loss_mask"])
        l1, _ = head.loss(b1, s1)
        l2, _ = head.loss(b2, s2)
        assert_same_numbers(l1, l2)
    with pytest.raises(SpecHeadsError, match="lacks"):
        offline.require([1], True)
