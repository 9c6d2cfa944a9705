"""The rendered book, opened page by page in headless Chromium, as a reader opens it.

Serves the built HTML (`COLOSSAL_LAB_BOOK_HTML`, default `_build/html`: `make book`) on
127.0.0.1 and drives the system Chromium through Playwright's Python API. Every page is
loaded once; the checks are separate tests over that one visit:

- no console errors and no uncaught page errors;
- no request leaves the site (all others are aborted, so nothing does, and listed);
- every formula is rendered by MathJax, and no raw TeX delimiters are left in the text;
- no raw markdown pipe tables in the text, and no raw pipe lines (a line of prose that
  starts with `|`, or a `|---|` / `|—|` separator row anywhere);
- no horizontal overflow in code or output blocks (at 1280x900, beyond a small allowance);
- no table wider than the text column, unless it scrolls inside its own box;
- no error text in cell outputs (a traceback, `SomethingError:`, "failed:", CUDA errors):
  a failed measurement reads as "—" with a footnote in words;
- no project references ("issue #14", "#14", "the issue that ...") and no commit hashes
  in the visible text (the Measurements appendix, which lists provenance, may show hashes);
- visible code inputs take at most `MAX_CODE_SHARE` of the article's height;
- no page taller than `MAX_PAGE_HEIGHT_PX`;
- every internal link resolves (page and `#fragment`), every image loads.

Pages still being converted are listed, per check, in `tests/book_backlog.py`: for those
a failing check is reported as an expected failure (xfail) with what it found.

These tests are marked `browser` and run only with `-m browser` (`make test` runs them
after `make book`). When they cannot run (no Chromium, no Playwright, no built book)
they fail under CI (`CI` set) and are skipped, with the reason, otherwise.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from book_backlog import PAGES_NOT_YET_CONVERTED

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
HTML_ROOT = Path(os.environ.get("COLOSSAL_LAB_BOOK_HTML") or REPO / "_build" / "html").resolve()
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")

VIEWPORT = {"width": 1280, "height": 900}
OVERFLOW_ALLOWANCE_PX = 8
MAX_CODE_SHARE = 0.15  # visible code inputs, as a share of the article's height
MAX_PAGE_HEIGHT_PX = 30_000  # at VIEWPORT's width
HASH_EXEMPT = {"book/measurements.html"}  # the provenance appendix lists commits
SHOW = 3  # offenders named in a failure message
NOT_PAGES = {"genindex.html", "search.html", "py-modindex.html"}
NOT_PAGE_DIRS = {"_static", "_sources", "_images", "_downloads", "_panels_static", ".doctrees"}
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def _cannot_run(reason: str):
    """Fail under CI, skip elsewhere: either way the reason is said plainly."""
    message = f"browser test could not run: {reason}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _toc_pages() -> list[str]:
    """`root:` and every `file:` of `_toc.yml`, as the HTML page each one must become."""
    toc = REPO / "_toc.yml"
    if not toc.exists():
        return []
    entries = re.findall(r"^\s*(?:-\s*)?(?:root|file):\s*['\"]?([^'\"\s#]+)", toc.read_text(),
                         flags=re.MULTILINE)
    return [re.sub(r"\.(ipynb|md|rst)$", "", entry) + ".html" for entry in entries]


def _is_redirect(path: Path) -> bool:
    head = path.read_text(errors="replace")[:2000]
    return bool(re.search(r"<meta[^>]+http-equiv=['\"]?refresh", head, flags=re.IGNORECASE))


def _built_pages() -> list[str]:
    """Every content page of the built book (not the index, search or redirect pages)."""
    if not HTML_ROOT.is_dir():
        return []
    pages = []
    for path in sorted(HTML_ROOT.rglob("*.html")):
        rel = path.relative_to(HTML_ROOT)
        if rel.parts[0] in NOT_PAGE_DIRS or rel.name in NOT_PAGES or _is_redirect(path):
            continue
        pages.append(rel.as_posix())
    return pages


# The pages the toc promises come first, so a missing build still lists (and fails) them.
PAGES = list(dict.fromkeys(_toc_pages() + _built_pages()))


def _page_id(rel: str) -> str:
    return rel.removesuffix(".html").removeprefix("book/")


def _find_chromium() -> str | None:
    for candidate in (os.environ.get("COLOSSAL_LAB_CHROMIUM"), "chromium", "chromium-browser",
                      "/usr/bin/chromium", "/usr/lib/chromium/chromium"):
        if candidate and (found := shutil.which(candidate)):
            return found
    return None


def _none(problems, message: str):
    """Fail with just `message` (no traceback, no repr of the data) when there are any."""
    if problems:
        pytest.fail(message, pytrace=False)


def _reader_check(rel: str, check: str, problems, message: str):
    """`_none`, except on a page `PAGES_NOT_YET_CONVERTED` lists for `check`: there a
    failure is an expected one (xfail, the message kept as its reason)."""
    if problems and check in PAGES_NOT_YET_CONVERTED.get(_page_id(rel), ()):
        pytest.xfail(f"[not yet converted] {message}")
    _none(problems, message)


def _first(items, n=SHOW) -> str:
    items = list(items)
    more = f"\n  ... and {len(items) - n} more" if len(items) > n else ""
    return "".join(f"\n  {item}" for item in items[:n]) + more


# In-page measurements, one script per check. Each returns plain JSON.

_MATH_JS = r"""() => {
  const sources = [...document.querySelectorAll('.math')];
  const unrendered = sources.filter(el => !el.querySelector('mjx-container'))
                            .map(el => el.textContent.trim().slice(0, 80));
  const errors = [...document.querySelectorAll('mjx-merror, [data-mjx-error]')]
                   .map(el => (el.getAttribute('data-mjx-error') || el.textContent).slice(0, 80));
  // Raw TeX left in visible prose: \( \[ $$ or $...\command...$.
  const raw = [];
  const skip = 'script, style, pre, code, textarea, mjx-container, .math, kbd, samp';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const pattern = /\\\(|\\\[|\$\$|\$[^$\s][^$]*\\[A-Za-z]+[^$]*\$/;
  while (walker.nextNode()) {
    const node = walker.currentNode, parent = node.parentElement;
    if (!parent || parent.closest(skip)) continue;
    if (!pattern.test(node.textContent)) continue;
    if (!parent.getClientRects().length) continue;  // not displayed
    raw.push(node.textContent.trim().slice(0, 80));
  }
  return {
    mathjax: !!(window.MathJax && window.MathJax.startup),
    sources: sources.length,
    rendered: document.querySelectorAll('mjx-container').length,
    unrendered, errors, raw,
  };
}"""

_PIPE_TABLE_JS = r"""() => {
  const blocks = document.querySelectorAll(
      'p, td, th, dd, dt, h1, h2, h3, h4, h5, h6, li:not(:has(p, li, pre))');
  const found = [];
  for (const el of blocks) {
    if (el.closest('pre, code, script, style, textarea')) continue;
    const text = el.textContent;
    if (/^\s*\|.*\|/s.test(text) && /\|\s*:?-{3,}/.test(text))
      found.push(el.tagName.toLowerCase() + ': ' + text.trim().replace(/\s+/g, ' ').slice(0, 80));
  }
  return found;
}"""

_OVERFLOW_JS = r"""(allowance) => {
  for (const d of document.querySelectorAll('details')) d.open = true;  // hidden cells too
  const blocks = new Set([...document.querySelectorAll(
      'div.highlight pre, div.cell_output pre, .output pre')]);
  const over = [];
  let shown = 0;
  for (const el of blocks) {
    if (!el.getClientRects().length) continue;  // not displayed (collapsed, hidden)
    shown += 1;
    const excess = el.scrollWidth - el.clientWidth;
    if (excess > allowance) {
      const kind = el.closest('div.cell_output, .output') ? 'output' : 'code';
      over.push({excess, kind, text: el.textContent.trim().split('\n')[0].slice(0, 80)});
    }
  }
  over.sort((a, b) => b.excess - a.excess);
  return {total: blocks.size, shown, over};
}"""

_PIPE_LINES_JS = r"""() => {
  // Prose whose line starts with "|" (a pipe table that did not render), and a
  // separator row ("|---|", "|—|") in any text, table cells included.
  const found = [];
  const prose = 'p, dd, dt, h1, h2, h3, h4, h5, h6, li:not(:has(p, li, pre)), td, th';
  for (const el of document.querySelectorAll(prose)) {
    if (el.closest('pre, code, script, style, textarea, .math, mjx-container')) continue;
    if (!el.getClientRects().length) continue;
    const cell = !!el.closest('td, th');  // |x| in a cell is a value, not a lost row
    for (const line of el.textContent.split('\n')) {
      const starts = !cell && /^\s*\|/.test(line);
      const rule = /\|\s*:?[-—–]{1,}\s*:?\s*\|/.test(line);
      if (starts || rule)
        found.push(el.tagName.toLowerCase() + ': ' + line.trim().slice(0, 80));
    }
  }
  return found;
}"""

_TABLES_JS = r"""(allowance) => {
  // A table fits when it ends inside the text column, or when it sits in a box of its
  // own that scrolls sideways (overflow-x auto/scroll) and that box fits.
  const article = document.querySelector('article.bd-article, article, main');
  if (!article) return {total: 0, wide: []};
  const col = article.getBoundingClientRect();
  const wide = [];
  const tables = [...article.querySelectorAll('table')].filter(t => t.getClientRects().length);
  for (const t of tables) {
    const r = t.getBoundingClientRect();
    if (r.right <= col.right + allowance && r.left >= col.left - allowance) continue;
    let box = t.parentElement, scrolls = false;
    while (box && box !== article) {
      const ox = getComputedStyle(box).overflowX;
      if (ox === 'auto' || ox === 'scroll') {
        const b = box.getBoundingClientRect();
        scrolls = b.right <= col.right + allowance;
        break;
      }
      box = box.parentElement;
    }
    if (scrolls) continue;
    const head = [...t.querySelectorAll('th')].map(th => th.textContent.trim()).join(' | ');
    wide.push({width: Math.round(r.width), column: Math.round(col.width),
               head: head.slice(0, 80)});
  }
  return {total: tables.length, wide};
}"""

_ERROR_TEXT_JS = r"""() => {
  // Exception text in what the cells printed or displayed (tables included).
  const pattern = new RegExp(['Traceback \\(most recent call last\\)',
    '\\b[A-Z]\\w*(?:Error|Exception):', '\\bfailed:', 'CUDA error',
    'CUDA out of memory', 'out of memory\\. Tried'].join('|'));
  const found = [];
  for (const el of document.querySelectorAll('div.cell_output, .output')) {
    if (!el.getClientRects().length) continue;
    const text = el.innerText;
    const m = text.match(pattern);
    if (m) {
      const at = Math.max(0, m.index - 30);
      found.push(text.slice(at, m.index + 70).replace(/\s+/g, ' ').trim());
    }
  }
  return [...new Set(found)];
}"""

_PROJECT_REFS_JS = r"""(hashes) => {
  // Lines written for the builders, not the reader, in the visible text (closed
  // dropdowns and hidden cells are not visible and not read).
  const article = document.querySelector('article.bd-article, article, main');
  if (!article) return [];
  // Code inputs are code, not text ("#999" is a colour): hidden while the text is read.
  const inputs = [...article.querySelectorAll('div.cell_input')];
  const shown = inputs.map(el => el.style.display);
  inputs.forEach(el => { el.style.display = 'none'; });
  const text = article.innerText;
  inputs.forEach((el, i) => { el.style.display = shown[i]; });
  const patterns = [
    [/\bissues?\s*#\s*\d+/gi, 'issue number'],
    [/(?<![\w&/#()"'])#\d{1,4}\b/g, '#NN'],
    [/\bthe issue(?:'s| that| which| planned| asked)\b/gi, 'the issue'],
  ];
  if (hashes)
    patterns.push([/\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b/g, 'commit hash']);
  const found = [];
  for (const [re, what] of patterns) {
    for (const m of text.matchAll(re)) {
      const around = text.slice(Math.max(0, m.index - 30), m.index + m[0].length + 30);
      found.push(what + ': …' + around.replace(/\s+/g, ' ') + '…');
    }
  }
  return found;
}"""

_LAYOUT_JS = r"""() => {
  // The page's height, and the share of the article's height that visible code
  // inputs take (cells folded by hide-input count only their toggle).
  const article = document.querySelector('article.bd-article, article, main');
  const height = Math.max(document.documentElement.scrollHeight, document.body.scrollHeight);
  if (!article) return {height, article: 0, code: 0, cells: []};
  let code = 0;
  const cells = [];
  for (const el of article.querySelectorAll('div.cell_input')) {
    if (!el.getClientRects().length) continue;
    const folded = el.closest('details');  // hide-input: inside a closed <details>
    if (folded && !folded.open && !el.closest('summary')) continue;
    const h = el.getBoundingClientRect().height;
    code += h;
    cells.push({h: Math.round(h), text: el.innerText.trim().split('\n')[0].slice(0, 70)});
  }
  cells.sort((a, b) => b.h - a.h);
  return {height, article: article.getBoundingClientRect().height, code,
          cells: cells.slice(0, 5)};
}"""

_LINKS_JS = r"""() => {
  const out = [];
  for (const a of document.querySelectorAll('a[href]')) {
    const raw = a.getAttribute('href');
    if (!raw || raw === '#' || raw.startsWith('javascript:')) continue;
    let url;
    try { url = new URL(a.href); } catch (e) { out.push({href: raw, bad: true}); continue; }
    if (url.origin !== location.origin) continue;
    const frag = url.hash ? decodeURIComponent(url.hash.slice(1)) : '';
    url.hash = '';
    const samePage = url.href === location.href.split('#')[0];
    out.push({href: raw, target: url.href, frag, samePage,
              found: samePage && frag ? !!document.getElementById(frag) : null});
  }
  return out;
}"""

_IMAGES_JS = r"""async () => {
  const imgs = [...document.images];
  for (const img of imgs) if (img.loading === 'lazy') img.loading = 'eager';
  await Promise.all(imgs.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener('load', done); img.addEventListener('error', done);
    setTimeout(done, 10000);
  })));
  return imgs.map(img => ({src: img.currentSrc || img.src, alt: img.alt,
                           ok: img.complete && img.naturalWidth > 0}));
}"""


@dataclass
class Visit:
    """What one load of one page showed."""

    url: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    math: dict = field(default_factory=dict)
    math_wait: str = ""
    pipe_tables: list[str] = field(default_factory=list)
    pipe_lines: list[str] = field(default_factory=list)
    tables: dict = field(default_factory=dict)
    error_text: list[str] = field(default_factory=list)
    project_refs: list[str] = field(default_factory=list)
    layout: dict = field(default_factory=dict)
    overflow: dict = field(default_factory=dict)
    links: list[dict] = field(default_factory=list)
    images: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""  # the page could not be loaded or measured


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A browser dropping a connection (a page closed mid-load) is no error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Book:
    """The served book and one Chromium; each page visited once, lazily, in a fresh
    context (as a first-time reader: no page's stored state hides another's errors)."""

    def __init__(self, browser, base: str):
        self.browser = browser
        self.base = base  # "http://127.0.0.1:PORT/"
        self.visits: dict[str, Visit] = {}
        self._fetched: dict[str, tuple[int, str]] = {}

    def is_local(self, url: str) -> bool:
        return url.startswith((self.base, "data:", "blob:", "about:"))

    def _route(self, route):
        if self.is_local(route.request.url):
            route.continue_()
        else:
            route.abort()  # nothing leaves the machine; the request is listed by `visit`

    def visit(self, rel: str) -> Visit:
        """The page's one visit (loaded on first use); fails the test if it could not load."""
        if rel not in self.visits:
            self.visits[rel] = self._load(rel)
        visit = self.visits[rel]
        if visit.error:
            pytest.fail(f"{rel}: {visit.error}", pytrace=False)
        return visit

    def _load(self, rel: str) -> Visit:
        visit = Visit(url=self.base + rel)
        if not (HTML_ROOT / rel).is_file():
            visit.error = f"not in the built book {HTML_ROOT} (listed in _toc.yml)"
            return visit
        start = time.monotonic()
        context = self.browser.new_context(viewport=VIEWPORT, service_workers="block")
        context.route("**/*", self._route)
        page = context.new_page()
        page.on("console", lambda msg: msg.type == "error" and visit.console_errors.append(
            f"{msg.text[:200]} (at {msg.location.get('url', '?')}:"
            f"{msg.location.get('lineNumber', '?')})"))
        page.on("pageerror", lambda err: visit.page_errors.append(str(err)[:200]))
        page.on("request", lambda req: None if self.is_local(req.url)
                else visit.outside.append(req.url))
        try:
            page.goto(visit.url, wait_until="load", timeout=30000)
            try:  # MathJax 3: typesetting is done when startup.promise resolves
                page.wait_for_function(
                    "() => !window.MathJax || (window.MathJax.startup"
                    " && window.MathJax.startup.promise)", timeout=10000)
                page.evaluate("() => window.MathJax && window.MathJax.startup"
                              " ? window.MathJax.startup.promise.then(() => true) : false")
            except Exception as exc:  # reported by the math check
                visit.math_wait = f"MathJax did not start or finish: {str(exc).splitlines()[0]}"
            visit.images = page.evaluate(_IMAGES_JS)
            visit.math = page.evaluate(_MATH_JS)
            visit.pipe_tables = page.evaluate(_PIPE_TABLE_JS)
            visit.pipe_lines = page.evaluate(_PIPE_LINES_JS)
            visit.tables = page.evaluate(_TABLES_JS, OVERFLOW_ALLOWANCE_PX)
            visit.error_text = page.evaluate(_ERROR_TEXT_JS)
            visit.project_refs = page.evaluate(_PROJECT_REFS_JS, rel not in HASH_EXEMPT)
            visit.layout = page.evaluate(_LAYOUT_JS)  # before any <details> is opened
            visit.links = page.evaluate(_LINKS_JS)
            # last, as it opens every <details> to measure the blocks hidden in them
            visit.overflow = page.evaluate(_OVERFLOW_JS, OVERFLOW_ALLOWANCE_PX)
            page.wait_for_timeout(200)  # late console errors / requests
        except Exception as exc:
            visit.error = f"could not load or measure the page: {str(exc)[:500]}"
        finally:
            context.close()
        visit.seconds = time.monotonic() - start
        return visit

    def fetch(self, url: str) -> tuple[int, str]:
        """Status and (for HTML) text of a same-site URL, fetched once."""
        if url not in self._fetched:
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    kind = resp.headers.get("Content-Type", "")
                    body = resp.read().decode("utf-8", "replace") if "html" in kind else ""
                    self._fetched[url] = (resp.status, body)
            except urllib.error.HTTPError as exc:
                self._fetched[url] = (exc.code, "")
            except OSError as exc:
                self._fetched[url] = (-1, str(exc))
        return self._fetched[url]


@pytest.fixture(scope="module")
def book():
    if not HTML_ROOT.is_dir() or not any(HTML_ROOT.rglob("*.html")):
        _cannot_run(f"no built book at {HTML_ROOT}: run `make book` first "
                    "(or set COLOSSAL_LAB_BOOK_HTML)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        _cannot_run(f"Playwright is not importable ({exc}): pip install -r requirements.txt")
    chromium = _find_chromium()
    if chromium is None:
        _cannot_run("no Chromium executable (apt-get install chromium)")

    handler = functools.partial(_QuietHandler, directory=str(HTML_ROOT))
    server = _Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with sync_playwright() as pw:
            try:
                browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                             args=CHROMIUM_ARGS)
            except Exception as exc:
                _cannot_run(f"Chromium ({chromium}) did not start: {str(exc)[:500]}")
            try:
                yield Book(browser, f"http://127.0.0.1:{server.server_address[1]}/")
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# --- the page list ------------------------------------------------------------------

def test_pages_cover_the_toc():
    if not HTML_ROOT.is_dir():
        _cannot_run(f"no built book at {HTML_ROOT}: run `make book` first")
    built = set(_built_pages())
    assert built, f"no content pages found under {HTML_ROOT}"
    toc = _toc_pages()
    assert toc, "_toc.yml lists no pages"
    missing = [rel for rel in toc if rel not in built]
    assert not missing, f"pages in _toc.yml but not in the built book:{_first(missing, 10)}"
    index = HTML_ROOT / "index.html"
    if index.exists() and _is_redirect(index):
        target = re.search(r"url=([^'\">\s]+)", index.read_text(), flags=re.IGNORECASE)
        assert target and (HTML_ROOT / target.group(1)).is_file(), (
            f"index.html redirects to a missing page: {target and target.group(1)}")


# --- per page -----------------------------------------------------------------------

pages = pytest.mark.parametrize("rel", PAGES, ids=[_page_id(p) for p in PAGES])


@pages
def test_no_console_errors(book, rel):
    visit = book.visit(rel)
    errors = [f"uncaught: {e}" for e in visit.page_errors] + visit.console_errors
    _none(errors,
          f"{rel}: {len(visit.page_errors)} uncaught page error(s), "
          f"{len(visit.console_errors)} console error(s):{_first(errors, 5)}")


@pages
def test_no_request_leaves_the_site(book, rel):
    visit = book.visit(rel)
    outside = list(dict.fromkeys(visit.outside))
    _none(outside,
          f"{rel}: {len(outside)} request(s) to outside the site (aborted):{_first(outside)}")


@pages
def test_math_is_rendered(book, rel):
    visit = book.visit(rel)
    math = visit.math
    unrendered = math["unrendered"]
    problems = []
    if unrendered:
        problems.append(f"not rendered:{_first(unrendered)}")
    if math["errors"]:
        problems.append(f"{len(math['errors'])} rendered as MathJax errors:"
                        f"{_first(math['errors'])}")
    if math["raw"]:
        problems.append(f"{len(math['raw'])} text node(s) show raw TeX:{_first(math['raw'])}")
    wait = f"; {visit.math_wait}" if visit.math_wait else ""
    _none(problems,
          f"{rel}: math {math['sources'] - len(unrendered)}/{math['sources']} rendered "
          f"({math['rendered']} mjx-container; MathJax loaded: {math['mathjax']}{wait})\n"
          + "\n".join(problems))


@pages
def test_no_raw_pipe_tables(book, rel):
    visit = book.visit(rel)
    _none(visit.pipe_tables,
          f"{rel}: {len(visit.pipe_tables)} raw pipe table(s) shown as text:"
          f"{_first(visit.pipe_tables)}")


@pages
def test_no_horizontal_overflow(book, rel):
    visit = book.visit(rel)
    over, shown = visit.overflow["over"], visit.overflow["shown"]
    code = sum(o["kind"] == "code" for o in over)
    worst = [f"+{o['excess']}px {o['kind']}: {o['text']}" for o in over]
    _none(over,
          f"{rel}: {len(over)} of {shown} code/output blocks overflow by more than "
          f"{OVERFLOW_ALLOWANCE_PX}px at {VIEWPORT['width']}x{VIEWPORT['height']} "
          f"({code} code, {len(over) - code} output); worst:"
          f"{_first(worst)}")


@pages
def test_internal_links_resolve(book, rel):
    visit = book.visit(rel)
    broken = []
    for link in visit.links:
        if link.get("bad"):
            broken.append(f"{link['href']}: not a URL")
            continue
        status, text = book.fetch(link["target"])
        if status != 200:
            broken.append(f"{link['href']}: HTTP {status}")
        elif link["frag"]:
            if link["samePage"]:
                found = link["found"]
            else:
                attr = r"""\b(?:id|name)=["']?""" + re.escape(link["frag"]) + r"""["'\s>]"""
                found = re.search(attr, text) is not None
            if not found:
                broken.append(f"{link['href']}: no element with id {link['frag']!r}")
    broken = list(dict.fromkeys(broken))
    _none(broken,
          f"{rel}: {len(broken)} of {len(visit.links)} internal link(s) do not resolve:"
          f"{_first(broken)}")


@pages
def test_images_load(book, rel):
    visit = book.visit(rel)
    failed = [f"{img['src']} (alt {img['alt']!r})" for img in visit.images if not img["ok"]]
    _none(failed,
          f"{rel}: {len(failed)} of {len(visit.images)} image(s) did not load:{_first(failed)}")


# --- what a reader sees (the reader checks; pages in tests/book_backlog.py: xfail) ------


@pages
def test_no_raw_pipe_lines(book, rel):
    visit = book.visit(rel)
    _reader_check(rel, "raw_pipe_lines", visit.pipe_lines,
                  f"{rel}: {len(visit.pipe_lines)} raw pipe line(s) in the text (a table "
                  f"that did not render; escape `|` inside cells):{_first(visit.pipe_lines)}")


@pages
def test_tables_fit_the_column(book, rel):
    visit = book.visit(rel)
    wide = [f"{t['width']}px in a {t['column']}px column: {t['head']}"
            for t in visit.tables["wide"]]
    _reader_check(rel, "tables_fit", wide,
                  f"{rel}: {len(wide)} of {visit.tables['total']} table(s) wider than the "
                  f"text column and not in a scrolling box of their own:{_first(wide)}")


@pages
def test_no_error_text_in_outputs(book, rel):
    visit = book.visit(rel)
    _reader_check(rel, "error_text", visit.error_text,
                  f"{rel}: {len(visit.error_text)} output(s) show exception text (show "
                  f"'—' and a footnote in words):{_first(visit.error_text)}")


@pages
def test_no_project_references(book, rel):
    visit = book.visit(rel)
    _reader_check(rel, "project_refs", visit.project_refs,
                  f"{rel}: {len(visit.project_refs)} project reference(s) or commit "
                  f"hash(es) in the visible text:{_first(visit.project_refs)}")


@pages
def test_visible_code_share(book, rel):
    visit = book.visit(rel)
    lay = visit.layout
    share = lay["code"] / lay["article"] if lay["article"] else 0.0
    biggest = [f"{c['h']}px: {c['text']}" for c in lay["cells"]]
    _reader_check(rel, "code_share", share > MAX_CODE_SHARE,
                  f"{rel}: visible code inputs take {share:.0%} of the article's "
                  f"{lay['article']:.0f}px (at most {MAX_CODE_SHARE:.0%}; fold plumbing "
                  f"with hide-input or remove-input); tallest:{_first(biggest)}")


@pages
def test_page_height(book, rel):
    visit = book.visit(rel)
    height = visit.layout["height"]
    _reader_check(rel, "page_height", height > MAX_PAGE_HEIGHT_PX,
                  f"{rel}: {height}px tall at {VIEWPORT['width']}px wide (at most "
                  f"{MAX_PAGE_HEIGHT_PX}px: cut repetition, fold detail into dropdowns, "
                  f"or move it to an appendix)")
