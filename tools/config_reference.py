"""Writes docs/configuration.md, the configuration reference, from the typed schemas.

Every key of every entry point (train, distill, infer, export) with its type, its default and
what it means, grouped as the config groups are. Everything comes from specheads/config/*.py:

- the keys, their types and their defaults from the dataclasses themselves (`dataclasses.fields`);
- a key's meaning from its field's own comment (`field_comments`), a group's from its class docstring;
- which head families read a `head.` key from `FAMILY_FIELDS`, and for a key every head stores, from
  the heads' code (`readers`);
- the options of each config group from conf/<group>/*.yaml, with the keys each sets to a value
  other than the schema's default.

The page is read on GitHub (the README links it) as well as in mkdocs, so it uses only Markdown both
render alike: no attr_list `{#id}` (headings are linked by their slug, `slug`) and no `|` or `<` that
either would misread (`inline`).

    python tools/config_reference.py            # rewrite docs/configuration.md
    python tools/config_reference.py --check    # exit 1 when docs/configuration.md is stale

tests/test_config_reference.py fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
sys.path.insert(0, str(ROOT))

from omegaconf import MISSING, OmegaConf  # noqa: E402

from specheads.config.distill import DistillJobConfig  # noqa: E402
from specheads.config.export import ExportJobConfig  # noqa: E402
from specheads.config.infer import InferJobConfig  # noqa: E402
from specheads.config.model import ModelConfig  # noqa: E402
from specheads.config.train import COMMON_HEAD_FIELDS, FAMILY_FIELDS, HeadConfig, TrainJobConfig  # noqa: E402
from specheads.heads.registry import HEADS  # noqa: E402

# entry point -> (its schema, the command, the primary config file, how it is run)
ENTRY_POINTS: dict[str, tuple[type, str, str]] = {
    "train": (TrainJobConfig, "conf/config.yaml", "`python train.py KEY=VALUE ...` or `specheads-train`"),
    "distill": (DistillJobConfig, "conf/distill.yaml", "`python distill.py KEY=VALUE ...` or `specheads-distill`"),
    "infer": (InferJobConfig, "conf/infer.yaml", "`python infer.py KEY=VALUE ...` or `specheads-infer`"),
    "export": (
        ExportJobConfig,
        "conf/export.yaml",
        "`python -m specheads.export KEY=VALUE ...` or `specheads-export`",
    ),
}
# config groups chosen by name on the command line (conf/<group>/NAME.yaml): group -> the schema
# field of an entry point that holds it
GROUPS = ("model", "head", "data", "deepspeed", "tree", "tracker")


def field_comments(cls: type) -> dict[str, str]:
    """Each field's own comment: the one ending its line, else the comment lines directly above it.
    Comment lines set off from the next field by a blank line, or above a field that has its own
    comment at the end of its line, head a group of fields and are no one field's meaning."""
    lines, _ = inspect.getsourcelines(cls)
    klass = ast.parse(textwrap.dedent("".join(lines))).body[0]
    assert isinstance(klass, ast.ClassDef)
    found: dict[str, str] = {}
    for node in klass.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        i = node.lineno - 2  # the line above the field, as an index into lines
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        found[node.target.id] = _inline_comment(lines[node.end_lineno - 1]) or " ".join(above)
    return found


def _inline_comment(line: str) -> str:
    """The comment ending a line of code, outside string literals."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            return line[i + 1 :].strip()
    return ""


def class_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(f"{cls.__name__}("):  # the dataclass's generated signature, not a docstring
        return ""
    return inline(" ".join(doc.split()))


def inline(text: str, cell: bool = False) -> str:
    """Comment text as Markdown that GitHub and mkdocs render alike. Outside code, `<` is escaped:
    both take `<arch>` for an HTML tag and show nothing. In a table cell a `|` outside code is
    `&#124;`, since inside a code span mkdocs shows the `\\|` escape as it is, and GitHub ends the
    cell at a `|` even there: one inside code cannot be written in a cell at all."""
    parts = re.split(r"(`[^`]*`)", text)  # odd parts are code spans
    for i, part in enumerate(parts):
        if i % 2:
            if cell and "|" in part:
                raise ValueError(f"{text!r}: a `|` inside code would end its table cell on GitHub; rephrase it")
            continue
        part = part.replace("<", "&lt;")
        parts[i] = part.replace("|", "&#124;") if cell else part
    return "".join(parts)


def type_name(field: dataclasses.Field) -> str:
    """`str or None` for `str | None`: a `|` cannot be written in a table cell's code (`inline`)."""
    return "`" + str(field.type).replace(" | ", " or ") + "`"


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return MISSING


def render_value(value: Any) -> str:
    if value is MISSING or value == "???":
        return "required"
    if dataclasses.is_dataclass(value):
        return "(group)"
    text = OmegaConf.to_yaml({"v": value}).strip()
    text = text[len("v:") :].strip() if text.startswith("v:") else text
    if isinstance(value, list | dict) and "\n" in text:
        text = _flow(value)
    return f"`{text}`"


def _flow(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def nested_schema(field: dataclasses.Field) -> type | None:
    """The dataclass a field holds (also when it may be null: `ModelConfig | None`)."""
    module = sys.modules[field.type.__module__] if not isinstance(field.type, str) else None
    names = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    for part in str(names).replace(" ", "").split("|"):
        for mod in (module, *[sys.modules[m] for m in _SCHEMA_MODULES]):
            if mod is None:
                continue
            candidate = getattr(mod, part, None)
            if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
                return candidate
    return None


_SCHEMA_MODULES = (
    "specheads.config.model",
    "specheads.config.train",
    "specheads.config.distill",
    "specheads.config.infer",
    "specheads.config.export",
)


def slug(heading: str) -> str:
    """The anchor GitHub and mkdocs (toc) both give a heading: lower case, punctuation dropped (code
    marks included), spaces as hyphens. The headings here have no two spaces or hyphens in a row,
    where the two differ."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-")


def group_heading(entry: str, key: str) -> str:
    """A nested schema's heading, as "infer: `tree.*`": its slug, infer-tree, is what other pages link to."""
    return f"{entry}: `{key}.*`"


def group_anchor(entry: str, key: str, schema: type | None) -> str:
    """Where a nested schema's keys are: under its own heading, or a shared group's one section."""
    return SHARED_ANCHOR.get(schema) or slug(group_heading(entry, key))


def readers(name: str) -> str:
    """The head families that read head.<name>: those FAMILY_FIELDS gives it to. A key every head
    stores (COMMON_HEAD_FIELDS) is read by the families whose head class, or a base of it, reads
    `spec.<name>`: every head stores draft_vocab_size, only one with a draft vocabulary reads it."""
    if name == "family":  # it picks the head class itself
        families = list(FAMILY_FIELDS)
    elif name in COMMON_HEAD_FIELDS:
        families = [family for family in FAMILY_FIELDS if re.search(rf"\bspec\.{name}\b", _head_code(family))]
    else:
        families = [family for family, own in FAMILY_FIELDS.items() if name in own]
    return "every family" if families == list(FAMILY_FIELDS) else ", ".join(families)


def _head_code(family: str) -> str:
    return "".join(inspect.getsource(k) for k in HEADS[family].__mro__ if k.__module__.startswith("specheads."))


def rows(cls: type, entry: str, prefix: str) -> list[str]:
    """The table of one schema's own keys (nested schemas get their own tables)."""
    families = cls is HeadConfig
    comments = field_comments(cls)
    if families:
        out = ["| key | type | default | read by | meaning |", "|---|---|---|---|---|"]
    else:
        out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        nested = nested_schema(field)
        meaning = inline(comments.get(field.name, ""), cell=True)
        key = f"{prefix}{field.name}"
        if nested is not None:
            meaning = (
                meaning + "; " if meaning else ""
            ) + f"its keys: [`{key}.*`](#{group_anchor(entry, key, nested)})"
            default = "`null`" if default_of(field) is None else "the group's defaults"
        else:
            default = render_value(default_of(field))
        cells = [f"`{key}`", type_name(field), default]
        if families:
            cells.append(readers(field.name))
        cells.append(meaning)
        out.append("| " + " | ".join(cells) + " |")
    return out


def section(cls: type, entry: str, prefix: str, level: int) -> list[str]:
    """A schema's table, then one section per nested schema under it."""
    out = []
    doc = class_doc(cls)
    if doc:
        out += [doc, ""]
    out += rows(cls, entry, prefix)
    out.append("")
    group = prefix.rstrip(".")
    if group in GROUPS and prefix.count(".") == 1:
        out += group_options(group, cls)
    for field in dataclasses.fields(cls):
        nested = nested_schema(field)
        if nested is None or nested in SHARED_ANCHOR:
            continue
        key = f"{prefix}{field.name}"
        out += [f"{'#' * level} {group_heading(entry, key)}", ""]
        out += section(nested, entry, f"{key}.", level + 1)
    return out


# groups every entry point shares: documented once, linked from each
MODEL_HEADING = "`model`: the frozen target"
SHARED_ANCHOR = {ModelConfig: slug(MODEL_HEADING)}


def group_options(group: str, schema: type) -> list[str]:
    """conf/<group>/*.yaml: each option and the keys it sets to other values than the schema's."""
    folder = ROOT / "conf" / group
    if not folder.is_dir():
        return []
    base = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    out = [f"Options of the `{group}` group (`{group}=NAME` picks conf/{group}/NAME.yaml), with what each sets:", ""]
    for path in sorted(folder.glob("*.yaml")):
        option = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        option.pop("defaults", None)
        if path.read_text().startswith("# @package _global_") and set(option) == {group}:
            option = option[group]  # a global option that sets its own group's keys (conf/tracker/)
        changed: list[str] = []
        for key, value in _flatten(option):
            if key.split(".")[0] == "arch":  # the target's sizes, for train.py's memory plan
                if "`arch`: the target's sizes" not in changed:
                    changed.append("`arch`: the target's sizes")
            elif _lookup(base, key) != value:
                changed.append(f"`{key}={_flow(value)}`")
        out.append(f"- `{path.stem}`: " + (", ".join(changed) or "the defaults"))
    out.append("")
    return out


def _flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        items = []
        for key, value in node.items():
            items += _flatten(value, f"{prefix}{key}.")
        return items
    return [(prefix.rstrip("."), node)]


def _lookup(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return object()
        node = node[part]
    return node


INTRO = """\
# Configuration reference

<!-- Generated by tools/config_reference.py from specheads/config/*.py and conf/: do not edit by
     hand. Run `python tools/config_reference.py`; tests/test_config_reference.py checks it. -->

Every key of every entry point, with its type, its default and what it means, read from the
typed schemas in `specheads/config/`, the one home of every default. Set a key on the command
line as `key=value` (`group.key=value` for a nested key, `'key=[a,b]'` for a list) and pick a
config group's option by name (`model=llama-3.1-8b`, `head=medusa`, `tree=auto`). An unknown key
or a value of the wrong type fails in one line before anything is loaded, and `--cfg job` prints
the composed config without running it.

Two kinds of file set other values than the defaults below: a group's option files (listed with
each group) and a recipe, `conf/recipe/<model>_<head>.yaml`, applied over them when the chosen
model and head have one (`smollm2-135m_eagle3` sizes the default `python train.py` for a 2-core
CPU). Values given on the command line win over both.

| entry point | run it | primary config | groups |
|---|---|---|---|
"""


def generate() -> str:
    out = [INTRO.rstrip("\n")]
    for entry, (schema, primary, command) in ENTRY_POINTS.items():
        groups = [f.name for f in dataclasses.fields(schema) if nested_schema(f) is not None]
        links = ", ".join(f"[`{g}`](#{group_anchor(entry, g, nested_schema(_field(schema, g)))})" for g in groups)
        out.append(f"| [{entry}](#{entry}) | {command} | `{primary}` | {links} |")
    out.append("")
    model_doc = class_doc(ModelConfig)
    out += [f"## {MODEL_HEADING}", ""]
    out += [
        f"{model_doc} Shared by every entry point: train and distill default to the embedded target; "
        "infer and export take the target named by the head unless `model=NAME` is given.",
        "",
    ]
    out += rows(ModelConfig, "model", "model.")
    out.append("")
    out += group_options("model", ModelConfig)
    for field in dataclasses.fields(ModelConfig):
        nested = nested_schema(field)
        if nested is not None:
            out += [f"### {group_heading('model', 'model.' + field.name)}", ""]
            out += section(nested, "model", f"model.{field.name}.", 4)
    for entry, (schema, primary, command) in ENTRY_POINTS.items():
        out += [f"## {entry}", "", f"{command}; primary config `{primary}`.", ""]
        out += section(schema, entry, "", 3)
    return "\n".join(out).rstrip("\n") + "\n"


def _field(schema: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(schema) if f.name == name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the schemas")
    args = parser.parse_args()
    text = generate()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python tools/config_reference.py", file=sys.stderr)
            sys.exit(1)
    else:
        PAGE.write_text(text)
