"""MkDocs hooks of the loradyn site (``hooks:`` in mkdocs.yml; not a page of the site).

mkdocs-click's option tables print ``option.default`` as it is. Since click 8.3 an option
given no default holds the sentinel ``UNSET`` there, which the tables would show as
``Sentinel.UNSET``: a flag's default is then ``False``, any other option has none (or is
required). The patch below shows those instead; it does nothing for a real default, and
nothing at all once mkdocs-click reads defaults itself.
"""

from __future__ import annotations

import copy


def _unset(value) -> bool:
    return type(value).__name__ == "Sentinel" or str(value).endswith("UNSET")


def on_config(config):
    from mkdocs_click import _docs

    original = getattr(_docs, "_loradyn_original_row", _docs._format_table_option_row)

    def row(option):
        if _unset(option.default):
            option = copy.copy(option)
            option.default = False if option.is_flag else None
        return original(option)

    _docs._loradyn_original_row = original
    _docs._format_table_option_row = row
    return config
