"""Sphinx extension: the repository and launch buttons follow the home.

The home is the one setting `repository.url` in _config.yml (Jupyter Book
passes it on as the theme's repository_url). While it is empty the book
shows neither button, since a button to nowhere is a broken link; once it
is set, the repository button and a Colab launch button (for the chapters'
GPU sections) appear, with no other edit. book/home.py writes the chapters'
setup cells from the same setting.
"""

COLAB = "https://colab.research.google.com"


def _follow_home(app, config):
    options = config.html_theme_options
    home = (options.get("repository_url") or "").strip()
    options["use_repository_button"] = bool(home)
    if home:  # empty launch URLs (Jupyter Book's defaults) show nothing
        launch = dict(options.get("launch_buttons") or {})
        launch["colab_url"] = launch.get("colab_url") or COLAB
        options["launch_buttons"] = launch


def setup(app):
    app.connect("config-inited", _follow_home)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
