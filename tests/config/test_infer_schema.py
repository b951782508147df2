"""specheads/config/infer.py: tree.save says where a calibrated tree goes (the machine's cache by
default, never the head directory unless asked); the old boolean values still read. bench.trees
entries read as the tree settings they name, or are refused with the forms they take."""

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from specheads.bench.trees import search_space
from specheads.config import register_configs, typed
from specheads.config.infer import SEARCH_DEFAULTS, parse_tree_spec, resolve_search, validate
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


def test_tree_dynamic_weighs_dynamic_trees_unless_told(hydra_conf):
    assert resolve_search(settings("tree=auto").tree).dynamic == "weigh"
    assert settings("tree=auto", "tree.dynamic=only").tree.dynamic == "only"
    with pytest.raises(SpecHeadsError, match="tree.dynamic must be one of weigh, off, only, got 'yes'"):
        settings("tree=auto", "tree.dynamic=yes")


def test_tree_auto_leaves_its_search_to_the_heads_record_unless_told(hydra_conf):
    """tree=auto composes with every search key None (the head's recorded search, else
    SEARCH_DEFAULTS); one given on the command line stays as given; README's command on the shipped
    head searches what its calibration searched (16 prompts of 128 tokens, depth 2, top_k 3)."""
    tree = settings("tree=auto").tree
    assert all(getattr(tree, k) is None for k in SEARCH_DEFAULTS)
    assert settings("tree=auto", "tree.calibration_tokens=32").tree.calibration_tokens == 32
    shipped = json.loads((CONF.parent / "heads" / "smollm2-135m-eagle3" / "config.json").read_text())["calibration"]
    searched = resolve_search(tree, search_space(shipped))
    assert (searched.calibration_prompts, searched.calibration_tokens, searched.depth, searched.top_k) == (
        16,
        128,
        2,
        3,
    )
    assert (searched.max_nodes, searched.dynamic) == (64, "weigh")
    assert resolve_search(tree) == dataclasses.replace(tree, **SEARCH_DEFAULTS)
    # the other kinds keep their sizes
    assert settings("tree=dynamic").tree.depth == 5 and settings("tree=chain").tree.depth == 4


def test_tree_replace_keeps_a_faster_calibration_unless_told(hydra_conf):
    assert settings("tree=auto").tree.replace == "if_faster"
    assert settings("tree=auto", "tree.replace=always").tree.replace == "always"
    assert settings("tree=auto", "tree.replace=true").tree.replace == "always"
    with pytest.raises(SpecHeadsError, match="tree.replace must be one of if_faster, always, got 'never'"):
        settings("tree=auto", "tree.replace=never")


def test_allow_target_mismatch_is_off_unless_asked(hydra_conf):
    assert settings().allow_target_mismatch is False
    assert settings("allow_target_mismatch=true").allow_target_mismatch is True


def test_the_bandwidth_probe_size(hydra_conf):
    assert settings().bench.bandwidth_mib == 256
    assert settings("bench.bandwidth_mib=0").bench.bandwidth_mib == 0  # off
    with pytest.raises(SpecHeadsError, match="bench.bandwidth_mib must be >= 0"):
        settings("bench.bandwidth_mib=-1")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("chain:3", {"kind": "chain", "depth": 3}),
        ("dynamic:2:3:4", {"kind": "dynamic", "depth": 2, "top_k": 3, "total_tokens": 4}),
        ("dynamic:2:3:4:0.05", {"kind": "dynamic", "depth": 2, "total_tokens": 4, "min_path_prob": 0.05}),
        ("static:[[0],[1],[0,0]]", {"kind": "static", "paths": [[0], [1], [0, 0]]}),
        ("default", {"kind": "default"}),
    ],
)
def test_tree_specs_read_as_the_tree_settings_they_name(spec, expected):
    tree = parse_tree_spec(spec)
    assert {k: getattr(tree, k) for k in {"min_path_prob": None, **expected}} == {"min_path_prob": None, **expected}


@pytest.mark.parametrize(
    "spec",
    ["chain", "chain:0", "chain:x", "dynamic:2:3", "dynamic:2:3:0", "static:[0,1]", "static:", "auto", "default:1"],
)
def test_a_malformed_tree_spec_is_refused_with_the_forms_it_takes(spec):
    with pytest.raises(
        SpecHeadsError, match=r"bench.trees: .* is not a tree; use chain:K, dynamic:DEPTH:TOP_K:NODES\[:P\]"
    ):
        parse_tree_spec(spec)


def test_bench_trees_come_through_the_command_line(hydra_conf, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("{}\n")
    s = settings(f"bench.questions={questions}", "bench.trees=[dynamic:2:3:4,chain:3,'static:[[0],[1]]']")
    assert s.bench.trees == ["dynamic:2:3:4", "chain:3", "static:[[0],[1]]"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["bench.trees=[chain:2]"], "bench.trees times the head with other trees"),  # no questions
        (["bench.trees=[chain:2]", "bench.mode=replay", "bench.questions=Q"], "bench.mode=replay already counts"),
        (["bench.trees=[chain:2,chain:2]", "bench.questions=Q"], "names a tree twice"),
        (["bench.trees=[tree:2]", "bench.questions=Q"], "'tree:2' is not a tree"),
    ],
)
def test_bench_trees_need_a_timed_benchmark_and_distinct_trees(hydra_conf, tmp_path, overrides, message):
    questions = tmp_path / "q.jsonl"
    questions.write_text("{}\n")
    with pytest.raises(SpecHeadsError, match=message):
        settings(*[o.replace("=Q", f"={questions}") for o in overrides])


def test_the_question_file_suffixes_are_the_readers():
    """config.infer checks a local question file before anything loads by the suffixes the reader knows."""
    from specheads.config.infer import QUESTION_FILE_SUFFIXES, named_as_local
    from specheads.data.formats import DATA_FILE_SUFFIXES

    assert QUESTION_FILE_SUFFIXES == DATA_FILE_SUFFIXES
    assert (
        named_as_local("q.jsonl") and named_as_local("./speed") and not named_as_local("nvidia/SPEED-Bench:qualitative")
    )
