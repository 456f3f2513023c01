"""Fonts for text that comes from the data: class names in any script.

matplotlib draws with DejaVu Sans, which has Latin, Greek and Cyrillic (``ü``) but no CJK: a
class named ``猫`` is an empty box and a warning per character on every redraw. matplotlib falls
back glyph by glyph along a list of families, so :func:`use_fonts_with_glyphs` gives each text
that needs it such a list: its own font first, then the installed fonts that have the characters
it lacks (Noto CJK, WenQuanYi, ... when the system has one), and last matplotlib's own "Last Resort"
font, which has a placeholder glyph for every code point. A name the system has no font for is
drawn as placeholders, silently, and the other texts keep their font.
"""
from __future__ import annotations

import functools
from typing import Any

LAST_RESORT = "Last Resort High-Efficiency"  # shipped with matplotlib (3.6 and later)


@functools.lru_cache(maxsize=None)
def _code_points(path: str) -> frozenset[int]:
    """The characters a font file maps (its first face), empty for a file FreeType cannot read."""
    from matplotlib.ft2font import FT2Font

    try:
        return frozenset(FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


@functools.lru_cache(maxsize=None)
def _fallbacks(missing: frozenset[int]) -> tuple[str, ...]:
    """The installed families that together have as many of ``missing`` as can be had, the one with
    the most of them first, then the Last Resort font where matplotlib has it."""
    from matplotlib import font_manager

    fonts = {f.fname: f.name for f in font_manager.fontManager.ttflist if f.name != LAST_RESORT}
    families: list[str] = []
    left = set(missing)
    while left:
        cover = {path: len(left & _code_points(path)) for path, name in fonts.items() if name not in families}
        best = max(cover, key=cover.get, default=None)
        if best is None or cover[best] == 0:
            break
        families.append(fonts[best])
        left -= _code_points(best)
    has_last_resort = any(f.name == LAST_RESORT for f in font_manager.fontManager.ttflist)
    return (*families, LAST_RESORT) if has_last_resort else tuple(families)


def use_fonts_with_glyphs(fig: Any) -> Any:
    """Give every text of ``fig`` (titles, tick labels, legends, annotations) whose characters its
    font lacks a family list that has them (the module's docstring); returns ``fig``."""
    from matplotlib import font_manager
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        content = text.get_text()
        if not content or content.isascii():
            continue
        path = font_manager.findfont(text.get_fontproperties())
        missing = frozenset(ord(c) for c in content if not c.isspace()) - _code_points(path)
        if missing:
            own = font_manager.get_font(path).family_name
            text.set_fontfamily([own, *_fallbacks(missing)])
    return fig
