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
    # a head of another tiny type than conf/model/tiny-random.yaml's: its identity names the source
    identity = {"source": "tiny:gpt_oss", "tiny": {"seed": 0, "num_hidden_layers": 4}}
    cfg = model_config_for_head({"target": {"name": "tiny-random", "identity": identity}}, CONF)
    assert (cfg.name, cfg.path, cfg.tiny) == ("tiny-random", "tiny:gpt_oss", identity["tiny"])
    with pytest.raises(SpecHeadsError):
        model_config_for_head({"target": {}}, CONF)


def test_infer_serving_a_head_with_another_thinking_setting_says_so(tmp_path, tiny_target, capsys):
    """infer.py's session loads a head trained with thinking off onto model.thinking=true: one line."""
    from conftest import quick_head

    from specheads.bench.session import load_session
    from specheads.chat_template import chat_record, set_thinking
    from specheads.config.infer import InferJobConfig
    from specheads.config.model import ModelConfig
    from specheads.heads import save_head
    from specheads.tiny import byte_tokenizer

    made = byte_tokenizer("thinking")
    set_thinking(made, False)
    directory = save_head(quick_head(tiny_target, "eagle3"), tmp_path / "head", training={"chat": chat_record(made)})
    model = ModelConfig(name="tiny-random", path="tiny:llama", tiny={"template": "thinking"}, thinking=True)
    settings = InferJobConfig(head_path=str(directory), model=model, prompt="hi", linear_layout="stock")
    capsys.readouterr()
    load_session(settings, CONF)
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and f"head {directory}" in err and "set model.thinking=false" in err
    settings.model = ModelConfig(**{**vars(model), "thinking": False})
    load_session(settings, CONF)
    assert "warning" not in capsys.readouterr().err
