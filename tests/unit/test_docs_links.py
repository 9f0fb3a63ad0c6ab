"""Every relative link in README.md and docs/*.md resolves: the file exists and, for a link to a
Markdown heading (`page.md#anchor`), the page has that heading (GitHub's anchor rules). Mentions of
`docs/….md` pages in the text must name pages that exist too. No network: web links are skipped."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
DOCS_MENTION = re.compile(r"(?<![\w/.-])docs/[\w./-]*?\.md\b")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, …


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path, cache: dict[Path, set[str]] = {}) -> set[str]:
    if page not in cache:
        seen: dict[str, int] = {}
        found = set()
        for _, line in prose_lines(page.read_text(encoding="utf-8")):
            m = HEADING.match(line)
            if not m:
                continue
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        cache[page] = found
    return cache[page]


def links(page: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        m = REFERENCE_DEF.match(line)
        if m:
            out.append((number, m.group(1)))
            continue
        for m in INLINE_LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((number, m.group(1)))
    return out


def problem(page: Path, target: str) -> str | None:
    """Why `target`, linked from `page`, does not resolve; None when it does."""
    if not target or EXTERNAL.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    dest = (page.parent / unquote(path_part)).resolve() if path_part else page
    if not dest.exists():
        return "no such file"
    if anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
        return f"no heading #{anchor} in {dest.name}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = [f"{page.relative_to(ROOT)}:{line}: ({target}) {why}"
              for line, target in links(page) if (why := problem(page, target))]
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_page_named_in_the_text_exists(page: Path):
    missing = [f"{page.relative_to(ROOT)}:{number}: {name}"
               for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
               for name in DOCS_MENTION.findall(line) if not (ROOT / name).exists()]
    assert not missing, "pages named but missing:\n" + "\n".join(missing)


def test_the_checker_finds_a_broken_link_and_a_missing_heading(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n## A heading: `with code` (and 2 things)\n"
                    "[ok](page.md#a-heading-with-code-and-2-things) [gone](nowhere.md) [bad](#no-such)\n"
                    "```\n[in a code block](nowhere.md)\n```\n`[in code](nowhere.md)` [web](https://example.com)\n")
    found = {target: problem(page, target) for _, target in links(page)}
    assert found == {"page.md#a-heading-with-code-and-2-things": None, "nowhere.md": "no such file",
                     "#no-such": "no heading #no-such in page.md", "https://example.com": None}
