"""The documentation site works offline: no remote script, MathJax served by the site itself.

mkdocs.yml's ``extra_javascript`` must name local files only, and docs/hooks.py must find the
MathJax bundle it copies into the site in the installed package (django-static-mathjax, the
``docs`` extra). A small site built with the real hooks and the real ``extra_javascript`` must
hold that bundle, its fonts, and no ``<script src="http...">``. Also the command reference's
option tables (mkdocs-click, patched in docs/hooks.py): a default resolved at run time shows
the help's ``[default: ...]``, not ``None``.

The tests needing the docs extra skip when mkdocs is not installed (``pip install -e ".[dev]"``
alone); CI installs ``.[dev,docs]`` and runs them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REMOTE = re.compile(r"^\s*(https?:)?//", re.IGNORECASE)
REMOTE_SCRIPT = re.compile(r"<script[^>]*\ssrc=[\"']?(https?:)?//", re.IGNORECASE)


def _extra_javascript() -> list[str]:
    """The entries of mkdocs.yml's top-level ``extra_javascript`` list (plain or ``path:``)."""
    entries, inside = [], False
    for line in (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines():
        if re.match(r"^extra_javascript\s*:", line):
            inside = True
            continue
        if inside:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if not line[0].isspace():
                break
            item = re.match(r"^\s*-\s*(?:path\s*:\s*)?(.+?)\s*$", line)
            if item:  # (a mapping entry's other keys, type: or async:, are not items)
                entries.append(item.group(1).strip("'\""))
    return entries


def _hooks():
    spec = importlib.util.spec_from_file_location("loradyn_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _needs_docs_extra():
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('the docs extra is not installed (pip install -e ".[docs]")')


def test_extra_javascript_is_local():
    scripts = _extra_javascript()
    assert scripts, "mkdocs.yml: no extra_javascript entries found"
    remote = [s for s in scripts if REMOTE.match(s)]
    assert not remote, f"mkdocs.yml loads remote scripts {remote}: the site must work offline"
    hooks = _hooks()
    assert hooks.MATHJAX_SCRIPT in scripts, (
        f"mkdocs.yml's extra_javascript {scripts} does not load the MathJax the hook copies "
        f"({hooks.MATHJAX_SCRIPT})")
    # the configuration (window.MathJax) must be read before MathJax starts
    assert scripts.index("javascripts/mathjax.js") < scripts.index(hooks.MATHJAX_SCRIPT)


def test_docs_sources_load_no_remote_script():
    sources = [p for p in (ROOT / "docs").rglob("*") if p.suffix in {".md", ".html", ".py"}]
    offenders = [str(p.relative_to(ROOT)) for p in sources
                 if REMOTE_SCRIPT.search(p.read_text(encoding="utf-8", errors="replace"))]
    assert not offenders, f"remote <script src> in {offenders}"


def test_mathjax_bundle_is_installed():
    _needs_docs_extra()
    hooks = _hooks()
    files = hooks.mathjax_files()  # FileNotFoundError names the package to install
    bundle = files[hooks.MATHJAX_SCRIPT]
    assert bundle.is_file() and bundle.stat().st_size > 500_000
    assert b"MathJax" in bundle.read_bytes()
    prefix = hooks.MATHJAX_DIR + "/"
    # what tex-mml-chtml.js loads on demand: CHTML fonts, TeX extensions (autoload)
    assert any(u.startswith(prefix + "output/chtml/fonts/woff-v2/") and u.endswith(".woff")
               for u in files)
    for ext in ("boldsymbol", "cancel", "mathtools"):
        assert prefix + f"input/tex/extensions/{ext}.js" in files
    assert all(path.is_file() for path in files.values())


def test_built_site_serves_mathjax_and_loads_nothing_remote(tmp_path):
    _needs_docs_extra()
    hooks = _hooks()
    docs = tmp_path / "docs"
    (docs / "javascripts").mkdir(parents=True)
    (docs / "javascripts" / "mathjax.js").write_text(
        (ROOT / "docs" / "javascripts" / "mathjax.js").read_text(encoding="utf-8"))
    (docs / "index.md").write_text("# Maths\n\nThe drift \\(h(m)\\) and\n\n"
                                   "\\[ \\bar m_{t+1} = \\bar m_t + \\eta h(\\bar m_t). \\]\n")
    scripts = "\n".join(f"  - {s}" for s in _extra_javascript())
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: offline\n"
        "docs_dir: docs\n"
        "site_dir: site\n"
        "use_directory_urls: false\n"
        "theme:\n  name: material\n"
        f"hooks:\n  - {(ROOT / 'docs' / 'hooks.py').as_posix()}\n"
        "markdown_extensions:\n  - pymdownx.arithmatex:\n      generic: true\n"
        f"extra_javascript:\n{scripts}\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    site = tmp_path / "site"
    assert (site / hooks.MATHJAX_SCRIPT).stat().st_size > 500_000
    assert list((site / hooks.MATHJAX_DIR / "output/chtml/fonts/woff-v2").glob("*.woff"))
    page = (site / "index.html").read_text(encoding="utf-8")
    assert not REMOTE_SCRIPT.search(page), "the built page loads a remote script"
    # the page's script tags resolve to files of the site
    sources = re.findall(r"<script[^>]*\ssrc=\"([^\"]+)\"", page)
    assert hooks.MATHJAX_SCRIPT in sources
    for src in sources:
        assert (site / src).is_file(), f"index.html loads {src}, not in the site"
    assert 'class="arithmatex"' in page


# --- the command reference's option tables ------------------------------------------------------


@pytest.fixture
def table_row(monkeypatch):
    """mkdocs-click's option-row formatter as patched by docs/hooks.py (undone afterwards)."""
    _needs_docs_extra()
    _docs = pytest.importorskip("mkdocs_click._docs")
    monkeypatch.setattr(_docs, "_format_table_option_row", _docs._format_table_option_row)
    monkeypatch.setattr(_docs, "_loradyn_original_row",
                        getattr(_docs, "_loradyn_original_row", _docs._format_table_option_row),
                        raising=False)
    _hooks().on_config(None)
    return _docs._format_table_option_row


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split(" | ")]


def test_run_learner_default_is_not_none(table_row):
    from sims.commands.run import run

    (learner,) = [p for p in run.params if "--learner" in getattr(p, "opts", ())]
    assert learner.default is None  # resolved at run time, said in the help
    cells = _cells(table_row(learner))
    assert len(cells) == 4
    assert cells[-1] != "None" and "finetune" in cells[-1]
    assert "[default:" not in cells[2]


def test_option_row_escapes_help_and_keeps_real_defaults(table_row):
    import click

    odd = click.Option(["--out"], default=None,
                       help="Largest |x| into <out> [default: results/<SPEC stem>.h5].")
    cells = _cells(table_row(odd))
    assert len(cells) == 4, cells  # the | of the help does not split the cell
    assert cells[2] == "Largest &#124;x&#124; into &lt;out&gt;."
    assert cells[3] == "results/&lt;SPEC stem&gt;.h5"
    real = click.Option(["--runs"], type=int, default=64, help="Runs [default: 64].")
    assert _cells(table_row(real))[-1] == "`64`"
    none = click.Option(["--plot"], default=None, help="A figure.")
    assert _cells(table_row(none))[-1] == "None"
