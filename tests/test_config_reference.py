"""docs/configuration.md is what tools/config_reference.py writes from the schemas, lists every key and
renders the same in mkdocs and on GitHub."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import inspect
import io
import re
import sys
import textwrap
import tokenize
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


def schema_fields(reference, schema: type, prefix: str = "") -> dict[str, type]:
    """Every dotted key of a schema, nested schemas included (also those that default to null), with
    the schema that declares it."""
    found = {}
    for field in dataclasses.fields(schema):
        key = f"{prefix}{field.name}"
        found[key] = schema
        nested = reference.nested_schema(field)
        if nested is not None:
            found |= schema_fields(reference, nested, f"{key}.")
    return found


def page_rows(reference) -> dict[tuple[str, str], list[str]]:
    """(entry point, key) -> the cells of its row; model.* is under the entry point `model`."""
    rows, entry = {}, ""
    for line in reference.PAGE.read_text().splitlines():
        if line.startswith("## "):
            entry = re.match(r"## `?(\w+)", line).group(1)
        elif line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[entry, cells[0].strip("`")] = cells
    return rows


def row(rows: dict, entry: str, key: str) -> list[str] | None:
    return rows.get(("model" if key.startswith("model.") else entry, key))


def test_every_key_of_every_entry_point_has_a_row_with_a_meaning(reference):
    rows = page_rows(reference)
    for entry, (schema, _, _) in reference.ENTRY_POINTS.items():
        for key in schema_fields(reference, schema):  # model.* is documented once, shared by every entry point
            assert row(rows, entry, key), f"{entry}: {key} is not in docs/configuration.md"
            assert row(rows, entry, key)[-1], f"{entry}: {key} has no meaning: add a comment above its field"
    page = reference.PAGE.read_text()
    for section in ("train", "distill", "infer", "export"):
        assert f"\n## {section}\n" in page


def test_a_changed_default_makes_the_page_stale(reference, monkeypatch):
    from specheads.config.train import TrainConfig

    lr = next(f for f in dataclasses.fields(TrainConfig) if f.name == "lr")
    before = reference.generate()
    monkeypatch.setattr(lr, "default", 1e-3)
    after = reference.generate()
    assert after != before and "| `train.lr` | `float` | `0.001` |" in after


def test_the_page_renders_the_same_in_mkdocs_and_on_github(reference):
    page = reference.PAGE.read_text()
    # mkdocs shows `\|` inside a code span as it is
    assert "\\|" not in page, "a `\\|` on the page"
    for line in page.splitlines():
        if line.startswith("|"):  # GitHub ends a table cell at any `|`, one inside a code span too
            assert not [span for span in re.findall(r"`[^`]*`", line) if "|" in span], line
    # outside code both take `<word>` for an HTML tag and show nothing
    text = re.sub(r"`[^`]*`", "", re.sub(r"<!--.*?-->", "", page, flags=re.S))
    assert "<" not in text, f"unescaped `<` outside code: {re.findall(r'<[^ ]*', text)}"


def test_the_links_into_the_page_name_its_headings(reference):
    """An anchor must be a heading's own slug, the same on GitHub and in mkdocs (attr_list's `{#id}`
    is shown as text on GitHub, where the README sends readers)."""
    page = reference.PAGE.read_text()
    assert "{#" not in page
    slugs = {reference.slug(line.lstrip("#").strip()) for line in page.splitlines() if line.startswith("#")}
    links = set(re.findall(r"\]\(#([^)]+)\)", page))
    for doc in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        links |= set(re.findall(r"configuration\.md#([\w-]+)", doc.read_text()))
    assert links and links <= slugs, sorted(links - slugs)


def comment_blocks(schema: type) -> list[str]:
    """A schema's comments as written: each run of comment lines, each comment that ends a line of code."""
    blocks, last, alone_before = [], -1, False
    source = textwrap.dedent(inspect.getsource(schema))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        text, alone = token.string.lstrip("#").strip(), token.line.strip().startswith("#")
        if alone and alone_before and token.start[0] == last + 1:
            blocks[-1] += " " + text
        else:
            blocks.append(text)
        last, alone_before = token.start[0], alone
    return blocks


def plain(text: str) -> str:
    return html.unescape(text).replace("`", "")


def test_each_meaning_is_one_comment_of_its_field(reference):
    """A meaning is one comment of its schema, and no other field's: never a comment that heads a
    group of fields run into a field's own."""
    rows, owners, wrong = page_rows(reference), {}, []
    for entry, (schema, _, _) in reference.ENTRY_POINTS.items():
        for key, declared in schema_fields(reference, schema).items():
            name, cells = key.split(".")[-1], row(rows, entry, key)
            meaning = plain(re.sub(r"(^|; )its keys: .*", "", cells[-1])) if cells else ""
            if meaning and meaning not in map(plain, comment_blocks(declared)):
                wrong.append(f"{key}: {meaning!r} is not one comment of {declared.__name__}")
            elif meaning and owners.setdefault((declared, meaning), name) != name:
                wrong.append(f"{key}: {meaning!r} is also {owners[declared, meaning]}'s")
    assert not wrong, "\n".join(wrong)


def test_read_by_names_the_families_that_read_the_key(reference):
    """Every head stores draft_vocab_size, but only a head with a draft vocabulary reads it."""
    from specheads.config.train import FAMILY_FIELDS, HeadConfig
    from specheads.heads.spec import HeadSpec
    from specheads.target import TargetInfo

    info = TargetInfo("t", "llama", 64, 1000, 4, 128, 4, 2, 16, 1e-5, 512)
    readers = row(page_rows(reference), "train", "head.draft_vocab_size")[3].split(", ")
    for family in FAMILY_FIELDS:
        head = HeadConfig(family=family, draft_vocab_size=100, draft_vocab=True)  # early_exit's, with draft_vocab
        assert (HeadSpec.from_config(head, info).draft_vocab_size == 100) == (family in readers), family
