"""The reader checks of tests/test_book_browser.py and tests/test_book_prose.py as one
Markdown report per page (what notes/book_reader.md records). Build the book first:

    PYTHONPATH=$PWD python notes/book_reader_report.py [PAGE_ID ...]
"""

import functools
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_book_browser as tb  # noqa: E402
import test_book_prose as tp  # noqa: E402

CHECKS = ("raw_pipe_lines", "tables_fit", "error_text", "project_refs", "code_share",
          "page_height", "typed_numbers")


def browser_offenders(only: list[str]) -> dict[str, dict]:
    from playwright.sync_api import sync_playwright

    handler = functools.partial(tb._QuietHandler, directory=str(tb.HTML_ROOT))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=tb._find_chromium(), headless=True,
                                     args=tb.CHROMIUM_ARGS)
        book = tb.Book(browser, f"http://127.0.0.1:{server.server_address[1]}/")
        for rel in tb.PAGES:
            pid = tb._page_id(rel)
            if only and pid not in only:
                continue
            v = book._load(rel)
            lay = v.layout or {}
            share = lay["code"] / lay["article"] if lay.get("article") else 0.0
            out[pid] = {
                "raw_pipe_lines": v.pipe_lines,
                "tables_fit": [f"{w['width']}px/{w['column']}px: {w['head']}"
                               for w in (v.tables or {}).get("wide", [])],
                "error_text": v.error_text,
                "project_refs": v.project_refs,
                "code_share": [f"{share:.0%}"] if share > tb.MAX_CODE_SHARE else [],
                "page_height": [f"{lay.get('height')}px"]
                if lay.get("height", 0) > tb.MAX_PAGE_HEIGHT_PX else [],
                "_share": share, "_height": lay.get("height"),
            }
        browser.close()
    server.shutdown()
    return out


def main(only: list[str]) -> None:
    found = browser_offenders(only)
    for path in tp.PAGES:
        if not only or path.stem in only:
            found.setdefault(path.stem, {})["typed_numbers"] = tp.typed_numbers(path)
    print("| page | height (px) | visible code | failing checks |\n|---|---|---|---|")
    for pid, d in found.items():
        bad = [c for c in CHECKS if d.get(c)]
        print(f"| {pid} | {d.get('_height', '')} | {d.get('_share', 0):.0%} | "
              f"{', '.join(bad) or '—'} |")
    for pid, d in found.items():
        bad = {c: d[c] for c in CHECKS if d.get(c)}
        if bad:
            print(f"\n### {pid}\n")
            for check, items in bad.items():
                print(f"- **{check}** ({len(items)}):")
                print("".join(f"  - {str(x)[:140]}\n" for x in items[:12]), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
