"""specheads/config/train.py: every head default has one home (the schema), which the command line
and the Python API share, and each family's fields are declared once."""

from dataclasses import asdict, fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from specheads.config import register_configs, typed
from specheads.config.train import COMMON_HEAD_FIELDS, FAMILY_FIELDS, HeadConfig, family_fields
from specheads.heads.registry import HEADS

CONF = Path(__file__).resolve().parents[2] / "conf"
HEAD_YAMLS = sorted((CONF / "head").glob("*.yaml"))


@pytest.fixture
def hydra_conf():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield
    GlobalHydra.instance().clear()


def test_every_family_has_a_head_yaml_and_declared_fields():
    assert {p.stem for p in HEAD_YAMLS} == set(HEADS) == set(FAMILY_FIELDS)
    declared = {f.name for f in fields(HeadConfig)}
    for family, own in FAMILY_FIELDS.items():
        assert set(own) <= declared, family
        assert len(set(own)) == len(own), f"{family} lists a field twice"
    used = set(COMMON_HEAD_FIELDS).union(*FAMILY_FIELDS.values())
    assert declared <= used, f"fields no family reads: {sorted(declared - used)}"


@pytest.mark.parametrize("path", HEAD_YAMLS, ids=lambda p: p.stem)
def test_head_yaml_selects_its_family_and_sets_no_default(path):
    """A value here would be a second home for a default the schema already holds."""
    data = OmegaConf.to_container(OmegaConf.load(path))
    data.pop("defaults", None)
    assert data == {"family": path.stem}


@pytest.mark.parametrize("family", sorted(FAMILY_FIELDS))
def test_command_line_and_python_api_train_the_same_head(family, hydra_conf):
    from_cli = typed(compose("config", [f"head={family}", "model=tiny-random"])).head
    assert asdict(from_cli) == asdict(HeadConfig(family=family))


def test_medusa2_defaults_are_the_measured_ones(hydra_conf):
    """The values BENCHMARKS.md measured (lambda 10, the LoRA at 5e-4), on both paths."""
    for head in (typed(compose("config", ["head=medusa2", "model=tiny-random"])).head, HeadConfig(family="medusa2")):
        assert (head.lm_loss_weight, head.lora_lr) == (10.0, 5e-4)


def test_family_fields_of_eagle3_hold_no_other_familys_knobs():
    own = set(family_fields("eagle3"))
    assert {"ttt_steps", "draft_vocab_size", "layer_ids"} <= own
    assert not own & {"lora_r", "hydra_teacher_loss", "medusa_decay", "heads_only_steps", "num_heads"}
