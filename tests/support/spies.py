"""A function replaced, for one test, by one that notes its first argument and calls it."""
from __future__ import annotations

from typing import Any


def calls_of(monkeypatch: Any, owner: Any, name: str) -> list[Any]:
    """``owner.name`` calling through for the rest of the test (``monkeypatch`` undoes it), each
    call's first argument appended to the list returned: which files were opened, parsed, ..."""
    seen: list[Any] = []
    real = getattr(owner, name)

    def noted(first: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(first)
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, noted)
    return seen
