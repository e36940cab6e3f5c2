"""Every link into a heading of the README or docs/ names a heading that exists.

An anchor is the heading as GitHub writes it: lower case, punctuation other than hyphens
dropped, spaces as hyphens, a repeated heading suffixed -1, -2, ... Benchmark headings carry
dates and times, and an edited time silently breaks the links to it: this catches that.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings (fenced code skipped)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"^#{1,6} (.*)", line)
        if fenced or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchor_slugs_follow_githubs_rule() -> None:
    text = "# Run 8: quack (H100, 2026-12-07, 17:16 UTC)\n## `/v1` and more\n## `/v1` and more\n"
    assert anchors(text) == {
        "run-8-quack-h100-2026-12-07-1716-utc", "v1-and-more", "v1-and-more-1",
    }  # fmt: skip


def test_every_heading_link_finds_its_heading() -> None:
    known = {f.resolve(): anchors(f.read_text()) for f in FILES}
    broken = []
    for f in FILES:
        for path, anchor in LINK.findall(f.read_text()):
            target = (f.parent / path).resolve() if path else f.resolve()
            if target in known and anchor not in known[target]:
                broken.append(f"{f.relative_to(ROOT)}: {path}#{anchor}")
    assert not broken, broken
