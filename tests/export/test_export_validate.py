"""Per-engine contracts: a valid export passes; each classic mistake is caught for the engine it
would break (and only where it breaks something)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from test_export import EAGLE3, edit_config, edit_tensors, make_head_dir

from specheads.export import check_directory, export_head
from specheads.export.validate import CONTRACTS, SRC_SGLANG_EAGLE3, SRC_TRTLLM_MEDUSA, engines_of


@pytest.fixture(scope="module")
def exports(tiny_target, tmp_path_factory):
    """One valid export per format, copied fresh for each test by `fresh`."""
    root = tmp_path_factory.mktemp("exports")
    e3 = make_head_dir(tiny_target, root / "e3", "eagle3", **EAGLE3)
    e1 = make_head_dir(tiny_target, root / "e1", "eagle", fc_bias=False)
    md = make_head_dir(tiny_target, root / "md", "medusa")
    df = make_head_dir(tiny_target, root / "df", "dflash")
    return {
        "dflash": export_head(df, "dflash", root / "dflash").path,
        "eagle3": export_head(e3, "eagle3", root / "eagle3", engine="sglang").path,
        "speculators": export_head(e3, "speculators", root / "speculators").path,
        "eagle": export_head(e1, "eagle", root / "eagle", target=tiny_target).path,
        "vllm-medusa": export_head(md, "vllm-medusa", root / "vllm-medusa").path,
        "medusa": export_head(md, "medusa", root / "medusa").path,
    }


@pytest.fixture
def fresh(exports, tmp_path):
    import shutil

    count = iter(range(100))

    def copy(fmt):
        return shutil.copytree(exports[fmt], tmp_path / f"{fmt}-{next(count)}")

    return copy


# Each engine's own repository: a contract must have been read off that engine's loader.
ENGINE_REPOS = {
    "vllm": "vllm-project/vllm",
    "sglang": "sgl-project/sglang",
    "speculators": "vllm-project/speculators",
    "trtllm": "NVIDIA/TensorRT-LLM",
    "tgi": "huggingface/text-generation-inference",
}
# what the first cited file's path names, per format: the loader of that format, not another's
FORMAT_WORDS = {
    "eagle3": r"eagle3",
    "dflash": r"dflash",
    "speculators": r"speculators",
    "eagle": r"eagle(?!3)",
    "vllm-medusa": r"medusa",
    "medusa": r"medusa",
}
# owner/repo@commit, optionally "(and COMMIT)" for a second commit read, then the loader's path
CITATION = re.compile(
    r"^(?P<repo>[\w.-]+/[\w.-]+)@(?P<commit>[0-9a-f]{7,40})(?: \(and [0-9a-f]{7,40}\))? (?P<path>[\w./-]+\.py)\b"
)


def citation_problems(contracts) -> list[str]:
    """Each contract's source starts with ENGINE_REPO@COMMIT path/to/loader.py, in its own engine's
    repository, with a path that names its format; and each engine's contract cites its own source."""
    problems = []
    for c in contracts:
        cited = CITATION.match(c.source)
        if cited is None:
            problems.append(f"{c.fmt}/{c.engine}: {c.source!r} does not start with owner/repo@commit path.py")
            continue
        if cited["repo"] != ENGINE_REPOS.get(c.engine):
            problems.append(f"{c.fmt}/{c.engine}: cites {cited['repo']}, not {ENGINE_REPOS.get(c.engine)}")
        if not re.search(FORMAT_WORDS[c.fmt], cited["path"]):
            problems.append(f"{c.fmt}/{c.engine}: {cited['path']} is not a {c.fmt} loader")
    return problems


def all_contracts():
    return [c for contracts in CONTRACTS.values() for c in contracts]


def test_every_contract_cites_its_own_engines_loader():
    assert {c.engine for c in all_contracts()} == set(ENGINE_REPOS)
    assert citation_problems(all_contracts()) == []


@pytest.mark.parametrize(
    "fmt, engine, source, problem",
    [
        ("eagle3", "vllm", SRC_SGLANG_EAGLE3, "cites sgl-project/sglang, not vllm-project/vllm"),
        ("eagle", "sglang", SRC_SGLANG_EAGLE3, "is not a eagle loader"),  # sglang's file, but EAGLE-3's
        ("medusa", "tgi", SRC_TRTLLM_MEDUSA, "cites NVIDIA/TensorRT-LLM"),
        ("eagle3", "vllm", "vllm/model_executor/models/llama_eagle3.py", "does not start with owner/repo@commit"),
        ("eagle3", "vllm", "vllm-project/vllm llama_eagle3.py", "does not start with owner/repo@commit"),
    ],
)
def test_the_citation_check_fails_on_a_miscited_contract(fmt, engine, source, problem):
    """The check can fail: a contract whose source is another engine's file, another format's
    loader, or no commit at all is reported."""
    broken = [replace(c, source=source) if (c.fmt, c.engine) == (fmt, engine) else c for c in all_contracts()]
    found = citation_problems(broken)
    assert len(found) == 1 and problem in found[0], found


@pytest.mark.parametrize("fmt", list(CONTRACTS))
def test_valid_exports_pass(exports, fmt):
    assert check_directory(exports[fmt], fmt) == {e: [] for e in engines_of(fmt)}


def problems(directory, fmt):
    return {engine: " | ".join(found) for engine, found in check_directory(directory, fmt).items()}


def rename(prefix_from, prefix_to):
    def change(tensors):
        for name in [n for n in tensors if n.startswith(prefix_from)]:
            tensors[prefix_to + name[len(prefix_from) :]] = tensors.pop(name)

    return change


def test_layers0_instead_of_midlayer_breaks_sglang_only(fresh):
    d = fresh("eagle3")
    edit_tensors(d, "model.safetensors", rename("midlayer.", "layers.0."))
    found = problems(d, "eagle3")
    assert "missing tensor midlayer.self_attn.q_proj.weight" in found["sglang"]
    assert found["vllm"] == ""  # vLLM renames midlayer. -> layers.0. itself


def test_midlayer_in_speculators_format_is_unknown_to_speculators(fresh):
    d = fresh("speculators")
    edit_tensors(d, "model.safetensors", rename("layers.0.", "midlayer."))
    assert "missing tensor layers.0.hidden_norm.weight" in problems(d, "speculators")["speculators"]


def test_d2t_as_absolute_ids_is_caught(fresh):
    for fmt in ("eagle3", "speculators"):
        d = fresh(fmt)
        edit_tensors(d, "model.safetensors", lambda t: t.__setitem__("d2t", torch.arange(t["d2t"].numel()) + t["d2t"]))
        found = problems(d, fmt)
        for engine in found:
            assert "offsets" in found[engine], (fmt, engine, found[engine])


def test_missing_norm_before_residual_is_caught(fresh):
    d = fresh("speculators")
    edit_config(d, lambda c: c.pop("norm_before_residual"))
    found = problems(d, "speculators")
    assert "norm_before_residual" in found["vllm"] and "norm_before_residual" in found["speculators"]


def test_speculators_config_structure(fresh):
    d = fresh("speculators")
    edit_config(d, lambda c: c["speculators_config"]["verifier"].pop("name_or_path"))
    assert "verifier.name_or_path" in problems(d, "speculators")["vllm"]
    edit_config(d, lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"))
    assert "speculative_tokens" in problems(d, "speculators")["vllm"]


def test_missing_or_misshapen_tensor(fresh):
    d = fresh("eagle3")
    edit_tensors(d, "model.safetensors", lambda t: t.pop("lm_head.weight"))
    assert all("missing tensor lm_head.weight" in p for p in problems(d, "eagle3").values())
    edit_tensors(d, "model.safetensors", lambda t: t.__setitem__("lm_head.weight", torch.zeros(96, 64)))
    edit_tensors(d, "model.safetensors", lambda t: t.__setitem__("fc.weight", t["fc.weight"].T.contiguous()))
    assert all("fc.weight has shape [192, 64], expected [64, 192]" in p for p in problems(d, "eagle3").values())


def test_sglang_needs_the_aux_flag_and_one_layer(fresh):
    d = fresh("eagle3")
    edit_config(d, lambda c: c["eagle_config"].pop("use_aux_hidden_state"))
    assert "use_aux_hidden_state" in problems(d, "eagle3")["sglang"]
    edit_config(
        d,
        lambda c: c.__setitem__(
            "eagle_config", {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 2]}
        ),
    )
    assert "3 layers" in problems(d, "eagle3")["sglang"]


def test_medusa_bias_trap(fresh):
    d = fresh("vllm-medusa")
    edit_config(d, lambda c: c.pop("medusa_fc_bias"))
    assert "medusa_fc_bias" in problems(d, "vllm-medusa")["vllm"]
    d = fresh("medusa")
    edit_tensors(d, "medusa_lm_head.safetensors", lambda t: t.pop("1.0.linear.bias"))
    found = problems(d, "medusa")
    assert "missing tensor 1.0.linear.bias" in found["trtllm"] and "missing tensor 1.0.linear.bias" in found["tgi"]


def test_medusa_config_fields(fresh):
    d = fresh("medusa")
    edit_config(d, lambda c: c.pop("base_model_name_or_path"))
    found = problems(d, "medusa")
    assert "base_model_name_or_path" in found["tgi"] and found["trtllm"] == ""
    edit_config(d, lambda c: c.pop("medusa_num_heads"))
    assert all("medusa_num_heads" in p for p in problems(d, "medusa").values())
    d = fresh("vllm-medusa")
    edit_config(d, lambda c: c.pop("num_heads"))
    assert "num_heads" in problems(d, "vllm-medusa")["vllm"]


def test_eagle1_layer0_norm_and_bias(fresh):
    d = fresh("eagle")
    edit_tensors(d, "model.safetensors", lambda t: t.__setitem__("layers.0.input_layernorm.weight", torch.ones(64)))
    assert all("unexpected tensors" in p for p in problems(d, "eagle").values())
    d = fresh("eagle")
    edit_tensors(d, "model.safetensors", lambda t: t.__setitem__("fc.bias", torch.ones(64)))
    found = problems(d, "eagle")
    assert "non-zero bias" in found["vllm"] and found["sglang"] == ""
    edit_tensors(d, "model.safetensors", lambda t: t.pop("fc.bias"))
    assert "missing tensor fc.bias" in problems(d, "eagle")["sglang"]


def test_architectures_must_name_the_engine_class(fresh):
    d = fresh("eagle")
    edit_config(d, lambda c: c.__setitem__("architectures", ["LlamaForCausalLMEagle"]))
    found = problems(d, "eagle")
    assert "EagleLlamaForCausalLM" in found["vllm"] and found["sglang"] == ""
    d = fresh("eagle3")
    edit_config(d, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"]))
    assert all("architectures" in p for p in problems(d, "eagle3").values())
