"""docs/configuration.md is what tools/config_reference.py writes from the schemas, and lists every key."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["config_reference"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("config_reference", None)


def test_committed_page_is_what_the_schemas_generate(reference):
    committed = reference.PAGE.read_text()
    assert committed == reference.generate(), (
        "docs/configuration.md differs from the schemas in specheads/config/: "
        "run `python tools/config_reference.py` and commit the page"
    )


def keys(reference, schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a schema, nested schemas included (also those that default to null)."""
    found = []
    for field in dataclasses.fields(schema):
        key = f"{prefix}{field.name}"
        found.append(key)
        nested = reference.nested_schema(field)
        if nested is not None:
            found += keys(reference, nested, f"{key}.")
    return found


def test_every_key_of_every_entry_point_has_a_row_with_a_meaning(reference):
    rows = {}
    for line in reference.PAGE.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = cells
    for entry, (schema, _, _) in reference.ENTRY_POINTS.items():
        for key in keys(reference, schema):  # model.* is documented once, shared by every entry point
            assert key in rows, f"{entry}: {key} is not in docs/configuration.md"
            assert rows[key][-1], f"{entry}: {key} has no meaning: add a comment above its field"
    for section in ("train", "distill", "infer", "export"):
        assert f"## {section} {{#{section}}}" in reference.PAGE.read_text()


def test_a_changed_default_makes_the_page_stale(reference, monkeypatch):
    from specheads.config.train import TrainConfig

    lr = next(f for f in dataclasses.fields(TrainConfig) if f.name == "lr")
    before = reference.generate()
    monkeypatch.setattr(lr, "default", 1e-3)
    after = reference.generate()
    assert after != before and "| `train.lr` | `float` | `0.001` |" in after
