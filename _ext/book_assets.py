"""A Sphinx extension of this book: each script included once per page, and every
notebook figure's alt text taken from the figure itself.

Alt text: `colossal_lab.book.notebook` writes what a figure shows (its title and axes,
`figure_alt`) into the PNG as a tEXt "Description"; myst-nb names the image by its hash
and sets no alt. `_figure_alt` reads the description back and makes it the image's alt,
so a reader without the image (or a screen reader) is told what it shows, not a file
name.

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


def _png_description(path) -> str | None:
    try:
        from PIL import Image

        with Image.open(path) as img:
            return (getattr(img, "text", None) or {}).get("Description")
    except Exception:  # not a PNG, unreadable: no alt from it
        return None


def _figure_alt(app, doctree, docname):
    from pathlib import Path

    from docutils import nodes

    here = Path(app.env.doc2path(docname)).parent
    for image in doctree.findall(nodes.image):
        if image.get("alt"):
            continue
        uri = image.get("uri", "")
        for path in (Path(uri), Path(app.srcdir) / uri, here / uri):
            if path.is_file():
                alt = _png_description(path)
                if alt:
                    image["alt"] = alt
                break


def setup(app):
    app.connect("html-page-context", _dedupe, priority=900)
    app.connect("doctree-resolved", _figure_alt)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
