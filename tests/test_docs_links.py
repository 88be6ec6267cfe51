"""The documentation a newcomer reads: README.md opens with the two commands and stays short, and every
relative link and anchor of README.md, docs/*.md, benchmarks/README.md and tests/README.md resolves
(anchors as GitHub makes them from headings), and none of them cites an issue or a field-case number.
In process, no network."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
         ROOT / "tests" / "README.md"]
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (links inside them are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``; a repeated heading gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` whose file or anchor does not exist, as ``target (why)``, with
    paths relative to ``root``."""
    problems = []
    for target in _LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{target} (no file {dest.relative_to(root) if dest.is_relative_to(root) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(root)})")
    return problems


def test_slug_follows_github():
    assert slug("Checkpoints, signals and resume") == "checkpoints-signals-and-resume"
    assert slug("`bench_step.py`: one step + more") == "bench_steppy-one-step--more"
    assert slug("8 OSFT as implemented") == "8-osft-as-implemented"


def test_a_missing_file_or_anchor_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A part\n")
    page.write_text("[ok](other.md#a-part) [top](#title) [gone](missing.md) [bad](other.md#nope) "
                    "`[code](missing.md)` [web](https://example.com)\n\n# Title\n\n```\n[fenced](missing2.md)\n```\n")
    assert broken_links(page, root=tmp_path) == ["missing.md (no file missing.md)",
                                                 "other.md#nope (no heading with anchor #nope in other.md)"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def test_readme_opens_with_the_two_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    assert lines[0].startswith("# ")
    body = [line for line in lines[1:] if line.strip()]
    assert body[0].startswith("```")  # the first thing after the title is a code block ...
    block = body[1:body.index("```", 1)]
    commands = [line.split("#")[0].strip() for line in block if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]  # ... of exactly the two commands
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_or_field_case_numbers(page):
    """A newcomer's page names the test or the docs section, not an issue or a field-case number."""
    found = re.findall(r"\b[Ii]ssues? #?\d+|\b[Ff]ield[- ]cases?\b|\bB[1-9]\d\b", page.read_text())
    assert found == []
