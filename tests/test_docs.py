"""The README and docs/ link only to files that exist: every picture, every page."""

import re

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_image_and_page_a_page_links_exists(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    missing = [link for link in local if not (page.parent / link).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"
    if page.name == "README.md":  # the front page shows the proof
        assert "docs/proof.png" in local
