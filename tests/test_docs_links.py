"""The README's and docs' own links resolve: every `[text](#anchor)` names a heading of its file
(GitHub's anchor rule) and every relative `[text](path)` names a file or folder of the repository.
A renamed heading otherwise leaves a dead link behind, silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
LINK = re.compile(r"\]\(([^)\s]*)\)")


def github_anchor(heading: str) -> str:
    """GitHub's slug: lower case, punctuation but '-' and '_' dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets GitHub's -1, -2, ... suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCED.sub("", markdown)):
        slug = github_anchor(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def dead_links(markdown: str, folder: Path) -> list[str]:
    """The links of one document (outside code blocks) that resolve to nothing."""
    text = FENCED.sub("", markdown)
    own = anchors(markdown)
    dead = []
    for target in LINK.findall(text.replace("\n", " ")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        if path and not (folder / path).exists():
            dead.append(target)
        elif not path and anchor not in own:
            dead.append(target)
    return dead


def test_github_anchor_follows_githubs_rule():
    assert github_anchor("The two headline cells (200 rounds) — not a reproduction") == (
        "the-two-headline-cells-200-rounds--not-a-reproduction")
    assert github_anchor("One architecture? The FedAvg CNN beside ResNet-18") == (
        "one-architecture-the-fedavg-cnn-beside-resnet-18")
    assert github_anchor("`fedmask_app`: the drivers") == "fedmask_app-the-drivers"


def test_dead_links_finds_a_stale_anchor_and_a_missing_file(tmp_path):
    (tmp_path / "here.md").write_text("")
    markdown = (
        "# Results\n## Results\n```bash\n# not a heading\n```\n"
        "[a](#results) [b](#results-1) [c](#not-a-heading) [d](here.md) [e](gone.md)\n"
        "[f](#results-2) [g](https://example.org/#x)\n")
    assert dead_links(markdown, tmp_path) == ["#not-a-heading", "gone.md", "#results-2"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(document):
    assert dead_links(document.read_text(), document.parent) == []
