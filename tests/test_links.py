"""The link table (`colossal_lab.book.links`) is well formed, pinned, and agrees with the book.

Offline checks only: every entry has a title and an https URL or a page of the book that
exists; ColossalAI's source is linked at `COLOSSALAI_COMMIT` and nowhere else; no URL
appears under two keys; chapter titles are the chapters' first headings; and
`book/references.md` lists exactly the table's external entries.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from colossal_lab.book import links
from colossal_lab.book.links import COLOSSALAI_COMMIT, LINKS, markdown_link

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
CAI = "https://github.com/hpcaitech/ColossalAI/"


def is_external(url: str) -> bool:
    return url.startswith("https://")


def first_heading(path: Path) -> str:
    """The text of the first `# ` heading of a notebook's or markdown page's source."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    else:
        text = path.read_text()
    match = re.search(r"^# (.+)$", text, re.M)
    assert match, f"{path} has no '# ' heading"
    return match.group(1).strip()


@pytest.mark.parametrize("key", sorted(LINKS))
def test_entry_has_title_and_target(key):
    title, url = LINKS[key]
    assert title.strip() == title and title, f"{key}: empty or padded title"
    assert "[" not in title and "]" not in title, f"{key}: brackets break link text"
    assert not re.search(r"\s", url), f"{key}: whitespace in {url!r}"
    if is_external(url):
        return
    assert not url.startswith(("/", "http:", ".")), f"{key}: {url!r} is neither https nor " \
        "a path relative to book/"
    assert (BOOK / url.split("#")[0]).is_file(), f"{key}: book/{url} does not exist"


def test_sections_do_not_share_keys():
    sections = (links.PAPERS, links.COLOSSALAI, links.DOCS, links.PROJECTS, links.CHAPTERS)
    assert sum(len(s) for s in sections) == len(LINKS), "a key is defined in two sections"


def test_no_url_under_two_keys():
    seen: dict[str, str] = {}
    for key, (_, url) in LINKS.items():
        assert url not in seen, f"{url} is under both {seen[url]!r} and {key!r}"
        seen[url] = key


def test_commit_is_a_full_sha():
    assert re.fullmatch(r"[0-9a-f]{40}", COLOSSALAI_COMMIT)


@pytest.mark.parametrize("key", sorted(k for k, (_, u) in LINKS.items() if u.startswith(CAI)))
def test_colossalai_links_are_pinned(key):
    """Source (blob/tree) at the one commit, with well-formed line anchors; issues and
    pull requests by number. Nothing on a branch such as `main`."""
    url = LINKS[key][1]
    rest = url[len(CAI):]
    if rest.startswith(("issues/", "pull/")):
        assert re.fullmatch(r"(issues|pull)/\d+", rest), url
        assert key == f"colossalai#{rest.split('/')[1]}", f"{key} links {url}"
        return
    kind, _, rest = rest.partition("/")
    assert kind in ("blob", "tree"), url
    assert rest.split("/")[0] == COLOSSALAI_COMMIT, f"{key}: {url} is not at COLOSSALAI_COMMIT"
    path, _, anchor = rest.partition("#")
    if anchor:
        assert kind == "blob" and re.fullmatch(r"L(\d+)(-L(\d+))?", anchor), url
        lines = [int(n) for n in re.findall(r"\d+", anchor)]
        assert lines == sorted(lines), f"{key}: line range {anchor} runs backwards"


def test_every_colossalai_entry_lives_on_github_at_the_repo():
    for key in links.COLOSSALAI:
        assert LINKS[key][1].startswith(CAI.rstrip("/")), key


@pytest.mark.parametrize("key", sorted(k for k, (_, u) in LINKS.items()
                                       if u.startswith("https://arxiv.org/")))
def test_arxiv_links_are_abstract_pages(key):
    assert re.fullmatch(r"https://arxiv\.org/abs/\d{4}\.\d{4,5}", LINKS[key][1]), key


@pytest.mark.parametrize("key", sorted(links.CHAPTERS))
def test_chapter_titles_are_the_pages_headings(key):
    title, path = links.CHAPTERS[key]
    heading = first_heading(BOOK / path)
    assert heading == title, (f"{key}: book/{path} is titled {heading!r}; update "
                              f"colossal_lab.book.links.CHAPTERS")


def test_every_page_in_the_toc_has_a_chapter_entry():
    toc = (ROOT / "_toc.yml").read_text()
    pages = re.findall(r"^\s*(?:root|- file):\s*book/(\S+)\s*$", toc, re.M)
    assert pages, "no pages found in _toc.yml"
    targets = {Path(path).with_suffix("").as_posix() for _, path in links.CHAPTERS.values()}
    missing = [p for p in pages if p not in targets]
    assert not missing, f"pages in _toc.yml without a CHAPTERS entry: {missing}"


def test_references_page_lists_exactly_the_external_entries():
    page = (BOOK / "references.md").read_text()
    assert page.startswith("# References\n")
    cited = set(re.findall(r"\]\((https://[^)\s]+)\)", page))
    external = {url for _, url in LINKS.values() if is_external(url)}
    assert cited - external == set(), f"URLs on the page but not in LINKS: {cited - external}"
    assert external - cited == set(), f"LINKS entries missing on the page: {external - cited}"
    for target in re.findall(r"\]\(([^)\s:]+)\)", page):
        assert (BOOK / target.split("#")[0]).is_file(), f"references.md links {target}"


def test_markdown_link_uses_the_title_by_default():
    title, url = LINKS["flashattention2"]
    assert markdown_link("flashattention2") == f"[{title}]({url})"
    assert url == "https://arxiv.org/abs/2307.08691"


def test_markdown_link_with_text():
    assert markdown_link("chapter:04", "chapter 04") == \
        "[chapter 04](04_gradient_checkpointing.ipynb)"
    assert markdown_link("colossalai#6390", "#6390") == \
        "[#6390](https://github.com/hpcaitech/ColossalAI/issues/6390)"
    assert markdown_link("colossalai:grad_ckpt_config", "") == \
        f"[]({CAI}blob/{COLOSSALAI_COMMIT}/colossalai/shardformer/shard/grad_ckpt_config.py)"


def test_markdown_link_unknown_key_says_what_exists():
    with pytest.raises(KeyError, match="flashattention2"):
        markdown_link("flashattention-2")
