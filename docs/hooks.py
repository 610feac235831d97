"""MkDocs hooks of the loradyn site (``hooks:`` in mkdocs.yml; not a page of the site).

MathJax, served by the site itself
----------------------------------
The formulas are typeset by MathJax 3, taken from the Python package ``django-static-mathjax``
(the ``docs`` extra; it ships MathJax's own ``es5`` build) rather than from a CDN, so the site
renders its maths offline and from ``file://``. :func:`on_files` adds the bundle
``tex-mml-chtml.js`` and the parts it loads on demand (TeX extensions, CHTML fonts, the menu's
accessibility and SVG options) to the site under :data:`MATHJAX_DIR`; mkdocs copies them like
any static file (``mkdocs build`` and ``mkdocs serve`` alike). ``extra_javascript`` in mkdocs.yml
names :data:`MATHJAX_SCRIPT`, after ``javascripts/mathjax.js`` (the configuration, which must come
first). tests/test_docs_offline.py checks both ends.

mkdocs-click's option tables
----------------------------
mkdocs-click prints ``option.default`` as it is. Since click 8.3 an option given no default holds
the sentinel ``UNSET`` there, which the tables would show as ``Sentinel.UNSET``: a flag's default
is then ``False``, any other option has none (or is required). An option whose default is
resolved at run time has ``default=None`` and says its real default in its help,
``[default: ...]`` (``loradyn run --learner``: finetune, or scratch for a committee teacher);
the tables would show ``None``, so that text moves to the default column. Help text is also
escaped for the Markdown table: ``|`` (``|λᵢ|``) would split a cell, and ``<out>`` would be read
as an HTML tag and vanish. The patch does nothing to a real default.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

#: where MathJax lands in the built site (relative to site_dir)
MATHJAX_DIR = "javascripts/vendor/mathjax"
#: the bundle the pages load (extra_javascript in mkdocs.yml)
MATHJAX_SCRIPT = f"{MATHJAX_DIR}/tex-mml-chtml.js"
#: the parts of MathJax's es5 build that tex-mml-chtml.js loads on demand
MATHJAX_PARTS = ("a11y", "input", "output", "sre", "ui")


def mathjax_source() -> Path:
    """MathJax's ``es5`` directory in the installed package ``django-static-mathjax``.

    Raises ``FileNotFoundError`` (with the command that installs it) when it is not there.
    """
    try:
        import mathjax  # django-static-mathjax: MathJax 3 under mathjax/static/mathjax
    except ImportError as exc:
        raise FileNotFoundError(
            "MathJax is not installed: the site serves it from the package "
            "django-static-mathjax (pip install -e \".[docs]\")") from exc
    es5 = Path(next(iter(mathjax.__path__))) / "static" / "mathjax" / "es5"
    if not (es5 / "tex-mml-chtml.js").is_file():
        raise FileNotFoundError(f"MathJax's es5 bundle is not in {es5} "
                                "(pip install -e \".[docs]\")")
    return es5


def mathjax_files() -> dict[str, Path]:
    """The files to put in the site: ``{uri under site_dir: source file}``."""
    es5 = mathjax_source()
    out = {MATHJAX_SCRIPT: es5 / "tex-mml-chtml.js"}
    licence = es5.parent / "LICENSE"
    if licence.is_file():
        out[f"{MATHJAX_DIR}/LICENSE"] = licence
    for part in MATHJAX_PARTS:
        for path in sorted((es5 / part).rglob("*")):
            if path.is_file():
                out[f"{MATHJAX_DIR}/{path.relative_to(es5).as_posix()}"] = path
    return out


def on_files(files, config):
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    try:
        wanted = mathjax_files()
    except FileNotFoundError as exc:
        raise PluginError(str(exc)) from exc
    for uri, path in wanted.items():
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=os.fspath(path)))
    return files


# --- mkdocs-click's option tables -------------------------------------------------------------

_DEFAULT_IN_HELP = re.compile(r"\s*\[default: ([^\]]*)\]")


def _unset(value) -> bool:
    return type(value).__name__ == "Sentinel" or str(value).endswith("UNSET")


def _escape_cell(text: str) -> str:
    """Text for a Markdown table cell: ``|``, ``<``, ``>`` escaped outside code spans."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):  # even indices: outside code spans
        parts[i] = (parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("|", "&#124;"))
    return "".join(parts)


def on_config(config):
    from mkdocs_click import _docs

    original = getattr(_docs, "_loradyn_original_row", _docs._format_table_option_row)

    def row(option):
        option = copy.copy(option)
        if _unset(option.default):
            option.default = False if option.is_flag else None
        default_text = None
        if option.help:
            help_text = option.help
            if option.default is None and not option.required:
                found = _DEFAULT_IN_HELP.search(help_text)
                if found:
                    default_text = found.group(1).strip()
                    help_text = help_text[:found.start()] + help_text[found.end():]
            option.help = _escape_cell(help_text)
        text = original(option)
        if default_text is not None:
            head, sep, _ = text.rstrip().rstrip("|").rstrip().rpartition(" | ")
            text = f"{head}{sep}{_escape_cell(default_text)} |"
        return text

    _docs._loradyn_original_row = original
    _docs._format_table_option_row = row
    return config
