"""A Sphinx extension of this book: each script included once per page.

With Sphinx 7.4, sphinx-thebe and sphinx-togglebutton add their inline set-up scripts
twice (once with an empty file name, once with none), so every page declared
`const THEBE_JS_URL` twice and the second declaration threw in the browser console.
Keep the first of scripts with the same file and attributes (inline: the same body).
"""


def _key(script) -> tuple:
    name = getattr(script, "filename", script) or ""
    return str(name), tuple(sorted(getattr(script, "attributes", {}).items()))


def _dedupe(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for script in scripts:
        if _key(script) not in seen:
            seen.add(_key(script))
            kept.append(script)
    scripts[:] = kept


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
