"""specheads/config/infer.py: tree.save says where a calibrated tree goes (the machine's cache by
default, never the head directory unless asked); the old boolean values still read."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specheads.config import register_configs, typed
from specheads.config.infer import validate
from specheads.errors import SpecHeadsError

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture
def hydra_conf():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield
    GlobalHydra.instance().clear()


def settings(*overrides):
    return validate(typed(compose("infer", ["head_path=/tmp", "prompt=hi", *overrides])))


@pytest.mark.parametrize(
    "overrides, save",
    [
        (["tree=auto"], "cache"),
        (["tree=auto", "tree.save=head"], "head"),
        (["tree=auto", "tree.save=none"], "none"),
        (["tree=auto", "tree.save=true"], "cache"),
        (["tree=auto", "tree.save=false"], "none"),
        ([], "cache"),
    ],
)
def test_tree_save(hydra_conf, overrides, save):
    assert settings(*overrides).tree.save == save


def test_a_bad_tree_save_is_one_line(hydra_conf):
    with pytest.raises(SpecHeadsError, match="tree.save must be one of cache, head, none, got 'disk'"):
        settings("tree=auto", "tree.save=disk")


def test_allow_target_mismatch_is_off_unless_asked(hydra_conf):
    assert settings().allow_target_mismatch is False
    assert settings("allow_target_mismatch=true").allow_target_mismatch is True


def test_the_bandwidth_probe_size(hydra_conf):
    assert settings().bench.bandwidth_mib == 256
    assert settings("bench.bandwidth_mib=0").bench.bandwidth_mib == 0  # off
    with pytest.raises(SpecHeadsError, match="bench.bandwidth_mib must be >= 0"):
        settings("bench.bandwidth_mib=-1")
