"""README.md and docs/*.md hold together: every relative link reaches a file, every `#anchor` a heading of
its page (GitHub's slug rule), README.md stays a short guide that links every page of docs/.

Reads files only: no processes, no imports of meshfit.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The page without code: fenced blocks and inline code spans hold no links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but '-' and '_' removed,
    spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_' (unicode letters too)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's slug; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, title in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(title)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I))


def test_the_slug_rule():
    assert slug("`meshfit verify`") == "meshfit-verify"
    assert slug("Held-out check (CPU ranks)") == "held-out-check-cpu-ranks"
    assert slug("Export to Hugging Face, and start from such weights") == \
        "export-to-hugging-face-and-start-from-such-weights"
    assert slug("ZeRO stages next to DeepSpeed's") == "zero-stages-next-to-deepspeeds"
    assert slug("`metrics.jsonl`") == "metricsjsonl"
    assert slug("Compiled blocks: step time") == "compiled-blocks-step-time"


def test_every_relative_link_reaches_a_file_and_a_heading():
    broken = []
    for page in PAGES:
        for target in links(page):
            if is_external(target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            name = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{name}: no file {path}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{name}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == []


def test_the_links_are_found():
    """The checks above see the links they should: README.md links into docs/, with anchors."""
    readme = links(ROOT / "README.md")
    assert "docs/planner.md#what-is-evaluated" in readme
    assert len([t for t in readme if "#" in t]) >= 5


def test_readme_is_a_short_guide():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move details to a page of docs/"


def test_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if not is_external(t)}
    missing = [p.relative_to(ROOT).as_posix() for p in PAGES[1:] if p.resolve() not in linked]
    assert missing == [], f"pages README.md does not link: {missing}"
