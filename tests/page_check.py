"""Reading back the HTML pages memlab writes: a strict tag-balance parser on Python's
``html.parser`` (every element closed in order, void elements aside), the cells of each table row,
the attributes of each element, and the vertices of an SVG path of absolute ``M``/``H``/``V``/``Z``
commands."""

from __future__ import annotations

import re
from html.parser import HTMLParser

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Page(HTMLParser):
    """A parsed page: ``errors`` (an end tag that closes no open element, an element left open),
    ``elements`` (tag, attributes) in order, ``rows`` (the text of each ``<td>``/``<th>`` per
    ``<tr>``, with a newline for each ``<li>`` and ``<br>``) and ``texts`` of SVG ``<title>``s."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.errors: list[str] = []
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.rows: list[list[str]] = []
        self.titles: list[str] = []
        self._open: list[str] = []
        self._cell: list[str] | None = None
        self._title: list[str] | None = None
        self.feed(text)
        self.close()
        if self._open:
            self.errors.append(f"left open: {self._open}")

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))
        if tag not in VOID:
            self._open.append(tag)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag in ("li", "br") and self._cell is not None:
            self._cell.append("\n")
        elif tag == "title" and "svg" in self._open:
            self._title = []

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        if not self._open or self._open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self._open[-1:] or 'nothing'}")
            return
        self._open.pop()
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "title" and self._title is not None:
            self.titles.append("".join(self._title))
            self._title = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._title is not None:
            self._title.append(data)

    def element(self, tag: str, **match: str) -> dict[str, str | None]:
        """The attributes of the one element ``tag`` whose attributes include ``match``."""
        (found,) = [a for t, a in self.elements if t == tag and all(a.get(k) == v for k, v in match.items())]
        return found


def vertices(path: str) -> list[tuple[float, float]]:
    """The points an SVG path of absolute ``M x,y``, ``H x``, ``V y`` and ``Z`` commands visits."""
    points: list[tuple[float, float]] = []
    for command, argument in re.findall(r"([MHVZ])([^MHVZ]*)", path):
        if command == "M":
            x, y = (float(v) for v in argument.split(","))
        elif command == "H":
            x = float(argument)
        elif command == "V":
            y = float(argument)
        else:
            continue
        points.append((x, y))
    return points
