"""What the attribute and lens pages share: escaping (every text from the user or the model is
escaped as the terminal escapes it, then for HTML) and the page around their tables."""

from __future__ import annotations

import html

from attnviz.errors import printable

STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse;"
         "margin:.5em 0 1.2em}td,th{padding:2px 6px;text-align:right;font:12px monospace}"
         "th{background:#eee}td.l{text-align:left}.dim{color:#666;font-size:12px}")


def esc(text: object) -> str:
    """HTML-escaped, and first escaped as the terminal escapes it (U+202E, ESC, …)."""
    return html.escape(printable(str(text), None), quote=True)


def page(title: str, body: list[str]) -> str:
    """A self-contained page: no script, no external resource."""
    return ("<!doctype html><html><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def diverging(value: float, bound: float) -> str:
    """A background from blue (negative) through white to red (positive), |value| / bound."""
    share = 0.0 if bound <= 0 else min(1.0, abs(value) / bound)
    fade = int(255 * (1 - share))
    return f"rgb(255,{fade},{fade})" if value > 0 else f"rgb({fade},{fade},255)"


def sequential(share: float) -> str:
    """A background from white (0) to green (1)."""
    fade = int(255 * (1 - max(0.0, min(1.0, share))))
    return f"rgb({fade},{int(128 + fade / 2)},{fade})"
