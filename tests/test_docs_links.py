"""Every relative link in the project's pages leads somewhere: the file
exists, and an anchor (#…) names a heading of that page as GitHub makes
its anchors. Pages move sections between them (benchmarks.md keeps the
newest round, bench-history.md the earlier ones); a link left behind would
send a reader to the top of the wrong page."""

from __future__ import annotations

import collections
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, the link
    syntax and every character but letters, digits, spaces, hyphens and
    underscores dropped, spaces made hyphens; a repeated one gets -1, -2 …"""
    out: set[str] = set()
    seen: collections.Counter = collections.Counter()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1).strip().lower())
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


def pages() -> list[str]:
    found = ["README.md", "CHANGELOG.md"]
    for d in ("docs", "examples", os.path.join("examples", "chat")):
        if os.path.isdir(os.path.join(ROOT, d)):
            found += [os.path.join(d, f) for f in sorted(os.listdir(os.path.join(ROOT, d))) if f.endswith(".md")]
    return [p for p in found if os.path.exists(os.path.join(ROOT, p))]


def test_the_anchor_rule_matches_headings_the_pages_link_to():
    text = "# A check round at `737fb4f`: the bench's method — [`x/`](x/)\n## Same\n## Same\n```\n# not one\n```\n"
    assert anchors(text) == {"a-check-round-at-737fb4f-the-benchs-method--x", "same", "same-1"}


@pytest.mark.parametrize("page", pages())
def test_every_relative_link_leads_somewhere(page):
    path = os.path.join(ROOT, page)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    bad = []
    for link in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto: …
            continue
        target, _, anchor = link.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if not os.path.exists(where):
            bad.append(f"{link}: no such file")
        elif anchor and where.endswith(".md"):
            with open(where, encoding="utf-8") as f:
                if anchor not in anchors(f.read()):
                    bad.append(f"{link}: no such heading")
    assert not bad, bad
