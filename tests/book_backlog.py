"""The book's pages that do not yet pass every reader check: one list, read by
`test_book_browser.py` (the built pages) and `test_book_prose.py` (the sources).

A page named here with a check's name has that check reported as an expected failure
(xfail, with what it found), not as a pass and not as a failure: the branch stays green
and the remaining work stays visible in every run (`pytest -rx`). Remove an entry as
soon as its page is converted; a listed check that passes is reported as XPASS.

Check names (browser): "raw_pipe_lines", "tables_fit", "error_text", "project_refs",
"code_share", "page_height"; (sources): "typed_numbers".
"""

PAGES_NOT_YET_CONVERTED: dict[str, set[str]] = {}
