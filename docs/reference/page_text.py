"""What every generated reference page shares: its first line, wrapped list items and the anchors.

The pages are read in a terminal and in a diff as often as rendered, so no line is longer than
``WIDTH`` where the words allow it: long text goes in a list item that wraps, never in a table cell.
"""

from __future__ import annotations

import re
import textwrap

COMMAND = "python docs/reference/generate.py"
WIDTH = 100


def first_line(source: str) -> str:
    """The line a generated page starts with: that it is generated, from what and by which command."""
    return f"<!-- Generated from {source} by `{COMMAND}`; do not edit by hand. -->"


def generated_note(source: str) -> str:
    """The same, as a paragraph the rendered page shows."""
    return wrap(f"Generated from {source} by `{COMMAND}`; do not edit by hand.")


def wrap(text: str, indent: str = "") -> str:
    """One paragraph wrapped at ``WIDTH``, every line after the first indented by ``indent``."""
    return "\n".join(textwrap.wrap(" ".join(text.split()), WIDTH, subsequent_indent=indent,
                                   break_on_hyphens=False, break_long_words=False))


def item(head: str, text: str = "") -> str:
    """A list item: ``head`` then ``text``, wrapped and indented as the item's continuation."""
    return wrap(f"- {head}" + (f" {text}" if text else ""), indent="  ")


def code(text: str) -> str:
    """Inline code that survives a backtick inside it."""
    text = " ".join(str(text).split())
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def row(cells: list[str] | tuple[str, ...]) -> str:
    """A table row; a pipe inside a cell is escaped so that it stays in its cell."""
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def anchor(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")
