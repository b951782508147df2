"""infer.py's session: which target a head was trained for."""

from pathlib import Path

import pytest

from specheads.bench.session import model_config_for_head
from specheads.errors import SpecHeadsError

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_model_config_from_the_head():
    cfg = model_config_for_head({"target": {"name": "tiny-random"}}, CONF)
    assert (cfg.name, cfg.path, cfg.tiny) == ("tiny-random", "tiny:llama", {"seed": 0})
    cfg = model_config_for_head({"target": {"name": "org/some-model", "revision": "abc"}}, CONF)
    assert (cfg.path, cfg.revision) == ("org/some-model", "abc")
    recorded = {"training": {"model": {"name": "x", "path": "tiny:qwen2"}}, "target": {"name": "x"}}
    assert model_config_for_head(recorded, CONF).path == "tiny:qwen2"
    with pytest.raises(SpecHeadsError):
        model_config_for_head({"target": {}}, CONF)
