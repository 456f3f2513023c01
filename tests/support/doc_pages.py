"""The docs' pages as the docs test reads them: each fenced block, the ``<!-- test[: OPTIONS] -->``
marker before it (tests/test_docs.py runs the marked ones) or ``<!-- file: NAME -->`` (a file the
page's commands use), and a page's files by name (tests/use/test_export.py runs docs/inference.md's script)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


DOCS = ROOT / "docs"


PAGES = sorted([*DOCS.glob("*.md"), *(DOCS / "recipes").glob("*.md")])


OPTIONS = {"setup", "continue", "fit-args", "exit", "timeout", "prints"}


MARK = re.compile(r"^\s*<!--\s*test(?::(?P<args>.*?))?\s*-->\s*$")


FILE_MARK = re.compile(r"^\s*<!--\s*file:\s*(?P<name>[\w.-]+)\s*-->\s*$")


FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")


# ----------------------------------------------------------------------------- reading the pages
@dataclass
class Block:
    page: Path
    line: int                      # 1-based line of the opening fence
    lang: str
    code: str
    options: dict[str, str] | None = None   # None: not marked
    file: str | None = None        # <!-- file: NAME -->
    marker_error: str = ""

    @property
    def where(self) -> str:
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        return f"{self.page.relative_to(ROOT)}:{self.line}: `{first}`"


def parse_options(text: str) -> tuple[dict[str, str], str]:
    try:
        tokens = shlex.split(text or "")
    except ValueError as err:
        return {}, f"marker options {text!r}: {err}"
    opts: dict[str, str] = {}
    for tok in tokens:
        key, _, value = tok.partition("=")
        if key not in OPTIONS:
            return opts, f"unknown marker option {key!r} (known: {', '.join(sorted(OPTIONS))})"
        opts[key] = value
    return opts, ""


def read_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group("fence"), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        block = Block(page, start + 1, m.group("lang"), "\n".join(lines[start + 1:j]) + "\n")
        prev = lines[start - 1] if start else ""
        if (mark := MARK.match(prev)):
            block.options, block.marker_error = parse_options(mark.group("args") or "")
        elif (fmark := FILE_MARK.match(prev)):
            block.file = fmark.group("name")
        blocks.append(block)
        i = j + 1
    return blocks


def stray_markers(page: Path) -> list[str]:
    """Marker lines not directly followed by a fence."""
    lines = page.read_text().splitlines()
    bad = []
    for n, line in enumerate(lines):
        if MARK.match(line) or FILE_MARK.match(line):
            nxt = lines[n + 1] if n + 1 < len(lines) else ""
            if not FENCE.match(nxt):
                bad.append(f"{page.relative_to(ROOT)}:{n + 1}: marker not followed by a fenced block")
    return bad


BLOCKS = {page: read_blocks(page) for page in PAGES}


def page_files(page: Path) -> dict[str, str]:
    return {b.file: b.code for b in BLOCKS[page] if b.file}


def docs_script(name: str) -> str:
    """A file block of docs/inference.md, as the docs test writes it."""
    return page_files(DOCS / "inference.md")[name]
