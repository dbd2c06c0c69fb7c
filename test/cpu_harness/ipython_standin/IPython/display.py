"""The two ``IPython.display`` names sglang.utils imports, as harmless stand-ins."""

from __future__ import annotations

from typing import Any


class HTML:
    """Holds markup; ``display`` of it prints the text (there is no notebook)."""

    def __init__(self, data: Any = None, *args: Any, **kwargs: Any) -> None:
        self.data = "" if data is None else str(data)

    def __repr__(self) -> str:
        return f"HTML({self.data!r})"

    def __str__(self) -> str:
        return self.data


def display(*objs: Any, **kwargs: Any) -> None:
    """Print each object (what a terminal IPython would show)."""
    for obj in objs:
        print(obj)
