"""The up-front check of image files: every file a split lists is opened before the first step.

Without it a file that cannot be read stops a run when the batch that holds it is loaded, one crash
per file, the next one only an epoch later. The check is PIL's ``Image.open`` (the format is
identified from the header, so a text file, an HTML page or a git-LFS pointer named ``.jpg`` fails
here) and then a test that the file is whole: a JPEG (or a phone's MPO) ends with its end-of-image
marker and a PNG with its IEND chunk, which a truncated download or copy lacks. A file without its
end marker (some tools append bytes after a JPEG's end) and every other format are decoded, a JPEG
at 1/8 scale (PIL's draft mode), and the decode decides. On 2,000 ImageNet-sized JPEGs (500 x 375,
88 kB, in the page cache) the check takes 0.13-0.24 s, about 0.1 ms a file, where a draft decode
takes 2.4 ms a file and a full decode 3.8 ms: about 2 minutes for ImageNet's 1.28 M training images
(plus, for files not in the page cache, the disk's time to read each one's first and last block),
against 50 minutes to decode them. A file damaged inside with an intact end is still found when it
is loaded.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Iterator, Sequence

from PIL import Image, UnidentifiedImageError

from visiontrain.data.image_verdicts import FileStamp, VerdictStore
from visiontrain.data.images import upright_size

#: The bytes a whole file of the format ends with.
END_MARKERS = {"JPEG": b"\xff\xd9", "MPO": b"\xff\xd9", "PNG": b"\x00\x00\x00\x00IEND\xaeB`\x82"}
NOT_AN_IMAGE = "is not an image: "
MISSING = "does not exist"
CORRUPT = "cannot be decoded (corrupt or truncated): "
HEIF_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"mif1", b"msf1", b"heim", b"heis")


def _ends_with(f: IO[bytes], marker: bytes) -> bool:
    size = f.seek(0, os.SEEK_END)
    if size < len(marker):
        return False
    f.seek(size - len(marker))
    return f.read(len(marker)) == marker


def what_it_is(head: bytes) -> str:
    """What a file PIL cannot identify most likely is, from its first bytes, in words that say how
    it came to be there (a git-LFS pointer from a clone without ``git lfs pull``, a saved web page)."""
    if not head:
        return "an empty file"
    if head.startswith(b"version https://git-lfs"):
        return "a git-LFS pointer, not the image (run `git lfs pull`)"
    if head.lstrip()[:14].lower().startswith((b"<!doctype html", b"<html")):
        return "an HTML page (a download that saved a web page)"
    if head[4:8] == b"ftyp" and head[8:12] in HEIF_BRANDS:
        return "a HEIC/HEIF photo, which PIL does not read (convert it to JPEG)"
    if b"\x00" not in head and not any(b < 9 or 13 < b < 32 for b in head):
        return "a text file"
    return "no image format PIL reads"


def image_problem(path: str) -> str | None:
    """None for a file that can be read whole; else what is wrong with it, as the end of a sentence
    that starts with the file's path ("does not exist", "is not an image: a text file", ...)."""
    return inspect_image(path)[0]


def inspect_image(path: str, size: bool = False, whole: bool = True) -> tuple[str | None, tuple[int, int] | None]:
    """``(image_problem(path), None)``, or for a file that can be read whole ``(None, its upright
    (width, height))`` when ``size`` is asked for (else None): the check and the header's size from
    one opening of the file, which is what a detection reader needs of each of COCO's 118k images.
    ``whole=False`` (``data.check_images=off``): the header alone, the file's end untested."""
    upright = None
    try:
        with open(path, "rb") as f:
            try:
                with Image.open(f) as im:
                    upright = upright_size(im) if size else None  # before draft(), which shrinks im.size
                    marker = END_MARKERS.get(im.format or "")
                    if whole and (marker is None or not _ends_with(f, marker)):
                        im.draft(im.mode, (1, 1))  # a JPEG decodes at 1/8 scale; other formats ignore it
                        im.load()  # seeks to the pixel data itself
            except UnidentifiedImageError:
                f.seek(0)
                return NOT_AN_IMAGE + what_it_is(f.read(512)), None
    except FileNotFoundError:
        return MISSING, None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        return CORRUPT + str(err), None
    return None, upright


def problem_kind(problem: str) -> str:
    """The kind of a problem, for counting likely causes: what a non-image is, else corrupt or missing."""
    if NOT_AN_IMAGE in problem:
        return problem.split(NOT_AN_IMAGE, 1)[1]
    return "truncated or corrupt files" if CORRUPT in problem else "missing files"


#: ``data.check_images``: every file opened and checked each run; a file's recorded verdict reused
#: while its size and modification time are unchanged (``image_verdicts``); no check.
CHECKS = ("full", "changed", "off")


def inspect_images(paths: Sequence[str], *, size: bool = False, check: str = "changed", workers: int = 8,
                   chunk: int = 1024) -> Iterator[tuple[str | None, tuple[int, int] | None]]:
    """``inspect_image`` of each path, in order, lazily by chunks (a reader's ``limit`` stops early,
    and a million paths do not make a million futures at once). The files are opened on a thread
    pool, since on a network file system each open waits on the server. Under ``changed`` a file whose
    verdict was recorded at its present size and modification time is not opened; ``full`` opens
    every file, ``off`` only reads the headers (for ``size``) and records nothing."""
    if check not in CHECKS:
        raise ValueError(f"data.check_images: expected one of {', '.join(CHECKS)}, got {check!r}")
    store = VerdictStore.default() if check != "off" else VerdictStore(None)
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        for start in range(0, len(paths), chunk):
            # the store's lock around one chunk, never across a yield: ranks checking the same split
            # take its chunks in turns, each chunk opened by one of them and found recorded by the rest
            with store.held() as verdicts:
                found = _inspect_chunk(paths[start:start + chunk], size, check, verdicts, pool)
            yield from found
    finally:
        # Not ``with``, whose exit joins the threads: a reader that stops early (``limit``) leaves this
        # generator to the garbage collector, which may close it on any thread, one of the next pool's
        # threads as it starts included, inside threading's own lock, which a join there takes again (a
        # hang). The idle threads end by themselves once told to.
        pool.shutdown(wait=False, cancel_futures=True)


def _inspect_chunk(paths: Sequence[str], size: bool, check: str, verdicts: VerdictStore,
                   pool: ThreadPoolExecutor) -> list[tuple[str | None, tuple[int, int] | None]]:
    stamps = list(pool.map(FileStamp.of, paths)) if verdicts.location else [None] * len(paths)
    known = verdicts.lookup([s for s in stamps if s is not None]) if check == "changed" else {}
    reused = {i: known[s.path] for i, s in enumerate(stamps) if s is not None and s.path in known
              and not (size and known[s.path] == (None, None))}  # a good file's verdict without its size
    todo = [i for i in range(len(paths)) if i not in reused]
    opened = dict(zip(todo, pool.map(lambda p: inspect_image(p, size=size, whole=check != "off"),
                                     [paths[i] for i in todo])))
    verdicts.record([(stamps[i], opened[i]) for i in todo if stamps[i] is not None])
    return [reused[i] if i in reused else opened[i] for i in range(len(paths))]


def unreadable_images(paths: Sequence[str], check: str = "changed") -> list[tuple[int, str]]:
    """``(index, problem)`` of each file of ``paths`` that cannot be read, in order (``inspect_images``)."""
    return [(i, problem) for i, (problem, _) in enumerate(inspect_images(paths, check=check)) if problem is not None]
