"""Every relative link in README.md, docs/*.md and the chart's README points at a file that
exists and, with a ``#fragment``, at a heading that file has.

Why: the README was cut into docs/ pages and sections move between them; a link to a
section that moved (``[Sizing](#sizing)`` left in a page that no longer has it) renders
fine and leads nowhere. Anchors are computed as GitHub renders them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "deploy" / "helm").glob("*/README.md"),
    ]
)
#: [text](target) and ![alt](target); the target ends at whitespace or ')'
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than
    '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks and indented code, code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def anchors(path: Path) -> set[str]:
    """The fragments a page answers: its headings' slugs (with GitHub's -1, -2 for repeats)
    and explicit ``id``/``name`` attributes."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = path.read_text()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            k = seen.get(s, 0)
            seen[s] = k + 1
            found.add(s if k == 0 else f"{s}-{k}")
    found.update(re.findall(r"""<a\s+(?:id|name)=["']([^"']+)["']""", text))
    return found


def broken_links(page: Path) -> list[str]:
    bad = []
    for n, line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, fragment = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such heading)")
    return bad


def test_pages_exist() -> None:
    assert (ROOT / "README.md").exists() and list((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme() -> None:
    """A page nobody links to is a page nobody finds."""
    readme = (ROOT / "README.md").read_text()
    orphans = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert orphans == []


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    """The checker itself: a missing file, a missing heading and a repeated heading."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Setup (`x`)\n\n## Setup (`x`)\n")
    page.write_text(
        "# Page\n\n[a](other.md#setup-x) [b](other.md#setup-x-1) [c](#page)\n"
        "[d](missing.md) [e](other.md#nowhere) [f](#nowhere)\n"
        "```\n[g](inside-a-fence.md)\n```\n`[h](in-a-code-span.md)`\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        bad = broken_links(page)
    finally:
        ROOT = saved
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md (no such file)",
        "other.md#nowhere (no such heading)",
        "#nowhere (no such heading)",
    ]


def test_readme_is_a_readme() -> None:
    """Issue 49: at most 400 lines, installing and `vllm serve` with its JSON on the first
    screen; the long form lives in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400, len(lines)
    first = "\n".join(lines[:60])
    assert "pip install" in first and "vllm serve" in first and "--kv-transfer-config" in first
    assert '"kv_connector_module_path": "kvtier.connectors.vllm"' in first


@pytest.mark.parametrize(
    "page", [p for p in PAGES if "helm" not in p.parts], ids=lambda p: str(p.relative_to(ROOT))
)
def test_no_install_from_an_index_that_lacks_kvtier(page: Path) -> None:
    """kvtier is not on PyPI: `pip install kvtier` (or `'kvtier[s3]'`) fails for a user."""
    text = page.read_text()
    assert not re.search(r"pip install[^\n`]*[\"' ]kvtier(\[|[\"' \n`]|$)", text)
