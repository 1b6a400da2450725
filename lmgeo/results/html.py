"""The report as one self-contained HTML page: the Markdown rendered by markdown-it-py (CommonMark and
tables), every image embedded as a base64 data URI, and an inline style sheet, so the page works offline
and can be mailed or archived as a single file.

Headings get GitHub's anchors (`heading_anchor`), so the report's table of contents links work on the page
and on GitHub alike; a figure with a one-column variant (`common.NARROW`) is shown as that variant on
screens narrower than `NARROW_SCREEN`, where the wide one's labels would be a few pixels tall."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token

from lmgeo.results.common import NARROW

NARROW_SCREEN = "(max-width: 700px)"
VIEWPORT = '<meta name="viewport" content="width=device-width, initial-scale=1">'  # phones lay out at their width
STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.85em; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; vertical-align: top; }
th { background: #f3f3f3; }
img { max-width: 100%; height: auto; }
code { background: #f5f5f5; padding: 0 0.2em; white-space: nowrap; }
code.long { white-space: normal; overflow-wrap: break-word; }
details { margin: 0.8em 0; }
summary { cursor: pointer; color: #333; }
@media (max-width: 700px) { body { margin: 0.5em auto; padding: 0 0.5em; } }
"""
MIME = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}


def heading_anchor(text: str, taken: set[str]) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens, `-1`, `-2`, … for
    repeats (`taken` collects the anchors given so far)."""
    slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
    anchor, n = slug, 0
    while anchor in taken:
        n += 1
        anchor = f"{slug}-{n}"
    taken.add(anchor)
    return anchor


def to_html(markdown: str, base: Path, title: str) -> str:
    """`markdown` as a complete page; image paths are read relative to `base` and embedded (a missing image
    is an error: the page would show a broken figure)."""
    md = MarkdownIt("commonmark", {"html": True}).enable("table")
    md.add_render_rule("image", _picture)
    md.add_render_rule("html_block", _only_folds)
    md.add_render_rule("html_inline", _only_folds)
    md.add_render_rule("code_inline", _code)
    tokens = md.parse(markdown)
    taken: set[str] = set()
    for i, token in enumerate(tokens):
        if token.type == "heading_open":
            token.attrSet("id", heading_anchor(tokens[i + 1].content, taken))
        for child in token.children or []:
            if child.type == "image":
                _embed(child, base / str(child.attrGet("src")))
    body = md.renderer.render(tokens, md.options, {})
    head = f'<meta charset="utf-8">\n{VIEWPORT}\n<title>{html.escape(title)}</title>\n<style>{STYLE}</style>'
    return f'<!DOCTYPE html>\n<html lang="en">\n<head>\n{head}\n</head>\n<body>\n{body}</body>\n</html>\n'


# The only raw HTML the report passes through: a folded table's `<details>`, its `<summary>` line, and its end
# (`common.markdown_table`); any other is shown as text, as with raw HTML off.
_FOLD = re.compile(r"\A(?:<details>\n<summary>[^<>]*</summary>|</details>)\n?\Z")


def _only_folds(renderer: RendererHTML, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
    content = tokens[idx].content
    if _FOLD.match(content):
        return content
    escaped = html.escape(content, quote=False)
    return f"<p>{escaped}</p>\n" if tokens[idx].type == "html_block" else escaped


SHORT_CODE = 32  # characters: a code span up to this long never wraps (about a third of a phone's width)


def _code(renderer: RendererHTML, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
    """A code span: a short one on one line (a name is never broken inside); a long one (a command, a query, a
    path) wraps, at its spaces, and in a path after `/`, `,` or `=`."""
    content = tokens[idx].content
    if len(content) <= SHORT_CODE:
        return f"<code>{html.escape(content)}</code>"
    broken = "<wbr>".join(html.escape(part) for part in re.split(r"(?<=[/,=])", content))
    return f'<code class="long">{broken}</code>'


def _embed(image: Token, path: Path) -> None:
    image.attrSet("src", _data_uri(path))
    narrow = path.with_name(f"{path.stem}{NARROW}{path.suffix}")
    if narrow.is_file():
        image.meta["narrow"] = _data_uri(narrow)


def _picture(renderer: RendererHTML, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
    """An image, inside a `<picture>` that swaps in its one-column variant on narrow screens where it has one."""
    img = renderer.image(tokens, idx, options, env)
    narrow = tokens[idx].meta.get("narrow")
    if narrow is None:
        return img
    return f'<picture><source media="{NARROW_SCREEN}" srcset="{narrow}">{img}</picture>'


def _data_uri(path: Path) -> str:
    return f"data:{MIME[path.suffix.lower()]};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"
