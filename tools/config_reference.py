"""Writes docs/configuration.md, the configuration reference, from the typed schemas.

Every key of every entry point (train, distill, infer, export) with its type, its default and
what it means, grouped as the config groups are. Everything comes from specheads/config/*.py:

- the keys, their types and their defaults from the dataclasses themselves (`dataclasses.fields`);
- a key's meaning from the comment lines directly above its field and the comment at the end of
  its line (read with `ast` and the source's lines), a group's from its class docstring;
- which head family reads a `head.` key from `FAMILY_FIELDS`;
- the options of each config group from conf/<group>/*.yaml, with the keys each sets to a value
  other than the schema's default.

    python tools/config_reference.py            # rewrite docs/configuration.md
    python tools/config_reference.py --check    # exit 1 when docs/configuration.md is stale

tests/test_config_reference.py fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
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
from specheads.config.train import FAMILY_FIELDS, HeadConfig, TrainJobConfig  # noqa: E402

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
    """Each field's comment: the comment lines directly above it plus the one ending its line."""
    lines, start = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    klass = tree.body[0]
    assert isinstance(klass, ast.ClassDef)
    text = [line.rstrip("\n") for line in lines]
    found: dict[str, str] = {}
    for node in klass.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        first = node.lineno - 1  # index into text
        above: list[str] = []
        i = first - 1
        while i >= 0 and text[i].strip().startswith("#"):
            above.insert(0, text[i].strip().lstrip("#").strip())
            i -= 1
        inline = _inline_comment(text[node.end_lineno - 1])
        parts = [" ".join(above)] if above else []
        if inline:
            parts.append(inline)
        found[node.target.id] = "; ".join(parts)
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
    return " ".join(doc.split())


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


def anchor(entry: str, key: str) -> str:
    return f"{entry}-" + key.replace(".", "-").replace("_", "-")


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
        meaning = comments.get(field.name, "").replace("|", "\\|")
        key = f"{prefix}{field.name}"
        if nested is not None:
            target = SHARED_ANCHOR[nested] if nested in SHARED_ANCHOR else anchor(entry, key)
            meaning = (meaning + "; " if meaning else "") + f"its keys: [`{key}.*`](#{target})"
            default = "`null`" if default_of(field) is None else "the group's defaults"
        else:
            default = render_value(default_of(field))
        cells = [f"`{key}`", "`" + str(field.type).replace("|", "\\|") + "`", default]
        if families:
            readers = [family for family, own in FAMILY_FIELDS.items() if field.name in own]
            cells.append(", ".join(readers) if readers else "every family")
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
        out += [f"{'#' * level} `{key}.*` {{#{anchor(entry, key)}}}", ""]
        out += section(nested, entry, f"{key}.", level + 1)
    return out


# groups every entry point shares: documented once, linked from each
SHARED_ANCHOR = {ModelConfig: "model-the-frozen-target"}


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
        links = ", ".join(
            f"[`{g}`](#{SHARED_ANCHOR.get(nested_schema(_field(schema, g)), anchor(entry, g))})" for g in groups
        )
        out.append(f"| [{entry}](#{entry}) | {command} | `{primary}` | {links} |")
    out.append("")
    model_doc = class_doc(ModelConfig)
    out += ["## `model`: the frozen target {#model-the-frozen-target}", ""]
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
            out += [f"### `model.{field.name}.*` {{#{anchor('model', 'model.' + field.name)}}}", ""]
            out += section(nested, "model", f"model.{field.name}.", 4)
    for entry, (schema, primary, command) in ENTRY_POINTS.items():
        out += [f"## {entry} {{#{entry}}}", "", f"{command}; primary config `{primary}`.", ""]
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
