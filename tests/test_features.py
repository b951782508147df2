import pytest
import torch

from specheads.errors import SpecHeadsError
from specheads.features import FeatureCache, collate_features, feature_cache_key, write_features


def rows(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 12 + 3 * i
        ids = torch.randint(0, 256, (t,), generator=g)
        mask = torch.zeros(t, dtype=torch.long)
        mask[t // 2:] = 1
        out.append({"input_ids": ids.tolist(), "loss_mask": mask.tolist()})
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_features_equal_online_bit_for_bit(tiny_target, tmp_path, dtype):
    data = rows()
    layers = [1, 3, 6]
    # small shards so that rows span several files
    index = write_features(tiny_target, data, layers, True, tmp_path / "feat", max_length=64,
                           dtype=dtype, shard_tokens=40)
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
