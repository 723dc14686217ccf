"""Sphinx extension: drop repeated <script> entries from every page.

sphinx-thebe and sphinx-togglebutton register their inline scripts once
per read of the environment, and Jupyter Book reads it twice (once with
filename None, once with ""), so each page declared `const THEBE_JS_URL`
twice and the browser stopped with a SyntaxError.
"""


def _dedupe(app, pagename, templatename, context, doctree):
    seen, kept = set(), []
    for script in context.get("script_files", []):
        # same file, or same inline body: the same script, whatever its
        # priority says
        attributes = getattr(script, "attributes", {})
        key = (getattr(script, "filename", str(script)) or "",  # None, ""
               attributes.get("body"))
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"][:] = kept  # in place: later handlers add to it


def setup(app):
    # html-page-context stops at the first handler that returns a template
    # name, so this one runs first
    app.connect("html-page-context", _dedupe, priority=100)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
