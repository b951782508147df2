"""Which target types vLLM serves EAGLE-3 drafts for (specheads.export.eagle3.VLLM_TARGETS): the
eagle3 and speculators exports record the verifier vLLM loads and its aux layers where it does,
and refuse in one line where it does not; the table is read against vLLM's own source where the
wheel or `make engines`' virtualenv is at hand."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from test_export import make_head_dir

from specheads.config.train import ModelConfig
from specheads.errors import SpecHeadsError
from specheads.export import export_head
from specheads.export.eagle3 import VLLM_TARGETS, VLLM_VERSION
from specheads.export.job import causal_lm_architecture
from specheads.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
MODELS = "vllm/model_executor/models/"


def vllm_sources() -> dict[str, str] | None:
    """vLLM's model sources by path (vllm/model_executor/models/**.py), from `make engines`'
    virtualenv; None without it."""
    for site in sorted((ROOT / ".venv-vllm" / "lib").glob(f"python*/site-packages/{MODELS}")):
        return {f"{MODELS}{p.relative_to(site).as_posix()}": p.read_text() for p in site.rglob("*.py")}
    return None


def module_path(sources: dict[str, str], module: str) -> str | None:
    """The source file of a module under vllm.model_executor.models ('llama', 'transformers/causal')."""
    return next((p for p in (f"{MODELS}{module}.py", f"{MODELS}{module}/__init__.py") if p in sources), None)


def imported_from(path: str, node: ast.ImportFrom) -> str | None:
    """The module (under vllm.model_executor.models) an import in the file `path` reads from."""
    name = node.module or ""
    if not node.level:
        prefix = MODELS.replace("/", ".")
        return name[len(prefix) :].replace(".", "/") if name.startswith(prefix) else None
    parts = path[len(MODELS) :].split("/")[:-1]  # the importing file's package
    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return "/".join([*parts, *name.split(".")]) if name else "/".join(parts)


def supports_eagle3(sources: dict[str, str], module: str, name: str, seen=()) -> bool:
    """Whether class `name` of vllm.model_executor.models.`module` has SupportsEagle3 among its
    bases, followed through the classes it inherits from (defined there, imported, or re-exported)."""
    path = module_path(sources, module)
    tree = ast.parse(sources[path])
    imported = {
        alias.asname or alias.name: (imported_from(path, node), alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:  # a package re-exporting the class
        source, original = imported.get(name, (None, None))
        return bool(source and module_path(sources, source)) and supports_eagle3(sources, source, original, seen)
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        if base_name == "SupportsEagle3":
            return True
        if (module, base_name) in seen:
            continue
        here = (*seen, (module, name))
        if any(isinstance(n, ast.ClassDef) and n.name == base_name for n in tree.body):
            if supports_eagle3(sources, module, base_name, here):
                return True
        elif base_name in imported:
            source, original = imported[base_name]
            if source and module_path(sources, source) and supports_eagle3(sources, source, original, here):
                return True
    return False


def registry(sources: dict[str, str]) -> dict[str, tuple[str, str]]:
    """vLLM's architecture -> (module, class) for text generation and its Transformers backend."""
    tree = ast.parse(sources[f"{MODELS}registry.py"])
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and len(value.elts) == 2:
                    out.setdefault(key.value, tuple(e.value for e in value.elts))
    return out


def test_the_table_names_the_architectures_the_export_records():
    for model_type, (architecture, _) in VLLM_TARGETS.items():
        assert causal_lm_architecture(model_type) == [architecture], model_type


def test_the_table_is_vllms_own():
    sources = vllm_sources()
    if sources is None:
        pytest.skip(f"no vLLM {VLLM_VERSION} source here (make engines builds .venv-vllm)")
    classes = registry(sources)
    for model_type, (architecture, served) in VLLM_TARGETS.items():
        module, name = classes[architecture]
        assert supports_eagle3(sources, module, name) == served, (model_type, module, name)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "qwen3_next", "mixtral", "gemma3_text", "falcon_h1"])
def test_exports_record_what_vllm_needs_or_refuse_in_one_line(model_type, tmp_path):
    cfg = ModelConfig(name=f"tiny-{model_type}", path=f"tiny:{model_type}", tiny={"num_hidden_layers": 4})
    target = load_target(cfg, device=torch.device("cpu"))
    head = make_head_dir(target, tmp_path / "head", "eagle3", draft_vocab_size=96)
    architecture, served = VLLM_TARGETS[model_type]
    if not served:
        for fmt in ("speculators", "eagle3"):
            with pytest.raises(SpecHeadsError, match=f"serves no EAGLE-3 draft for a {model_type} target") as err:
                export_head(head, fmt, tmp_path / fmt, target=target)
            assert "\n" not in str(err.value) and architecture in str(err.value)
        export_head(head, "eagle3", tmp_path / "sglang", engine="sglang", target=target)  # SGLang's layout alone
        return
    out = export_head(head, "speculators", tmp_path / "spec", verifier_architectures=[architecture], target=target)
    config = json.loads((out.path / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["architectures"] == [architecture]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]  # vLLM's default for 4 layers
    assert "vllm" in export_head(head, "eagle3", tmp_path / "research", target=target).engines
