"""mkdocs hooks (mkdocs.yml `hooks:`): the site's results page is BENCHMARKS.md itself.

docs/results.md is a stand-in; at build time its text is BENCHMARKS.md's, with the links that
point from the repository's root into docs/ made relative to the site, so the one file stays
the one home of the results and `mkdocs build --strict` checks its links like any page's.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_PAGE = "results.md"


def site_links(markdown: str) -> str:
    """BENCHMARKS.md's links, from the repository's root, as links from a page of docs/."""
    markdown = re.sub(r"\]\(docs/", "](", markdown)
    return re.sub(r"\]\(README\.md\)", "](index.md)", markdown)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (mkdocs' hook signature)
    if page.file.src_uri == RESULTS_PAGE:
        return site_links((ROOT / "BENCHMARKS.md").read_text())
    return markdown
