"""mkdocs hooks (mkdocs.yml `hooks:`): the site's results page is BENCHMARKS.md itself, and the
Studies section lists every page of docs/studies/.

`on_files` adds `results.md` to the site as a generated file whose text is BENCHMARKS.md's, with
the links that point from the repository's root into docs/ made relative to the site, so the one
file stays the one home of the results and `mkdocs build --strict` checks its links like any
page's; a page of docs/ links it as ../BENCHMARKS.md, which works on GitHub, and
`on_page_markdown` makes that the results page on the site. `on_config` expands the nav entry
`Studies: studies/` into the index and every study page, in the order of the index's table,
newest first (a page's title is its first heading), so a new study needs no nav edit.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PAGE = "results.md"
STUDIES = "studies/"


def site_links(markdown: str) -> str:
    """BENCHMARKS.md's links, from the repository's root, as links from a page of docs/."""
    markdown = re.sub(r"\]\(docs/", "](", markdown)
    return re.sub(r"\]\(README\.md\)", "](index.md)", markdown)


def study_pages(docs_dir: Path) -> list[str]:
    """docs/studies/'s index, then its pages in the index's order (newest first), then any page
    the index does not link yet, newest first by name."""
    folder = docs_dir / STUDIES
    listed = re.findall(r"\]\(([^)/#]+\.md)\)", (folder / "index.md").read_text())
    pages = [name for name in dict.fromkeys(listed) if (folder / name).is_file()]
    pages += sorted((p.name for p in folder.glob("*.md") if p.name not in {"index.md", *pages}), reverse=True)
    return [f"{STUDIES}index.md", *(f"{STUDIES}{name}" for name in pages)]


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (mkdocs' hook signature)
    """A page of docs/ links the results as ../BENCHMARKS.md (so the link works on GitHub too); on
    the site that is the results page."""
    depth = page.file.src_uri.count("/")
    return re.sub(
        r"\]\(" + re.escape("../" * (depth + 1)) + r"BENCHMARKS\.md", "](" + "../" * depth + RESULTS_PAGE, markdown
    )


def on_config(config):
    docs_dir = Path(config["docs_dir"])
    for item in config["nav"] or []:
        if isinstance(item, dict):
            for title, target in item.items():
                if target == STUDIES:
                    item[title] = study_pages(docs_dir)
    return config


def on_files(files, config):
    files.append(File.generated(config, RESULTS_PAGE, content=site_links((ROOT / "BENCHMARKS.md").read_text())))
    return files
