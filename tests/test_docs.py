"""The docs' commands, run; and every command line and config key they name, checked.

Pages: docs/*.md and docs/recipes/*.md. A fenced ```bash block preceded by an HTML comment
``<!-- test[: OPTION ...] -->`` on the line just before its opening fence is run with
``bash -e -o pipefail`` in a scratch directory, with the venv's ``visiontrain`` and ``python`` first
on PATH (``visiontrain`` through the warm Python of ``tests/support/procs.py``: the same console script,
forked with torch already imported). Options (docs/README.md lists them for writers):

    setup=NAME[,NAME]     build fixtures first: coco, voc, yolo, image-folder, segmentation-folder,
                          voc-segmentation, cityscapes, ade20k, coco-panoptic, cityscapes-panoptic
                          (tiny datasets)
    continue              run in the previous marked block's directory, after it
    fit-args="k=v ..."    append these overrides to every `fit` command of the block (after its own)
    exit=N                expected exit status; each "# visiontrain: error: ..." comment line of the
                          block must then appear in stderr
    prints                each "# ..." comment line of the block is a line it prints: it must appear
                          in its output (stdout or stderr; a log line's timestamp left out)
    timeout=S             seconds allowed (default 300)

A fenced block preceded by ``<!-- file: NAME -->`` is written to NAME in the directory of every
marked block of its page (the custom task's module and recipe). A block and the ``continue``
blocks after it form a chain, one test; the chains run two at a time in the background
(VISIONTRAIN_DOCS_JOBS changes the number), which saves about a third of the wall time on two cores.

Every page, marked or not, is also checked statically: each `visiontrain` command line in a shell
block must parse with the CLI's own parser and, for fit / show-config / benchmark, load its
recipe with its overrides; every config key written in code (inline or fenced) must exist; every
relative link and anchor must resolve; every full-scale recipe has a page; every command that
trains a small recipe is marked, but for one that is only the recipe as shipped
(``visiontrain fit RECIPE --run-dir DIR``), which tests/app/test_recipes.py runs.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dataset_trees import build_coco, build_image_folder, build_voc, build_yolo
from panoptic_trees import write_cityscapes_panoptic, write_coco_panoptic
from segmentation_dataset_trees import write_ade20k, write_cityscapes
from segmentation_trees import write_segmentation_folder, write_voc_segmentation
from doc_pages import BLOCKS, DOCS, FENCE, PAGES, ROOT, Block, page_files, stray_markers
from procs import shell_env
from shipped import LENGTH_AND_SIZE
from visiontrain.core import config as C


FULL_RECIPES = ("classify-mobilevit-imagenet", "detect-detr-r50-coco", "detect-detr-fast-r50-coco",
                "detect-faster-rcnn-r50-coco", "detect-yolov3-darknet53-voc", "segment-mask-rcnn-r50-coco",
                "segment-deeplabv3plus-r50-cityscapes", "segment-panoptic-fpn-r50-coco", "ssl-dino-vits16-imagenet")
SMALL_RECIPES = ("classify-fashion", "detect-detr", "detect-faster-rcnn", "detect-yolov3", "segment-mask-rcnn",
                 "segment-panoptic", "segment-semantic", "ssl-dino")
DEFAULT_TIMEOUT = 300
JOBS = int(os.environ.get("VISIONTRAIN_DOCS_JOBS", min(2, os.cpu_count() or 1)))


@dataclass
class Chain:
    page: Path
    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(DOCS)}:{self.blocks[0].line}"


def build_chains() -> list[Chain]:
    chains: list[Chain] = []
    for page, blocks in BLOCKS.items():
        current: Chain | None = None
        for b in blocks:
            if b.options is None:
                continue
            if "continue" in b.options and current is not None:
                current.blocks.append(b)
            else:
                current = Chain(page, [b])
                chains.append(current)
    return chains


CHAINS = {c.id: c for c in build_chains()}


# ----------------------------------------------------------------------------- fixtures
SETUPS = {"coco": ("coco", build_coco), "voc": ("VOC2007", build_voc), "yolo": ("yolo", build_yolo),
          "image-folder": ("imagefolder", build_image_folder),
          "segmentation-folder": ("segfolder", write_segmentation_folder),
          "voc-segmentation": ("VOC2012", write_voc_segmentation), "cityscapes": ("cityscapes", write_cityscapes),
          "ade20k": ("ADEChallengeData2016", write_ade20k),
          "coco-panoptic": ("coco", lambda root: write_coco_panoptic(root, {"train2017": 6, "val2017": 3})),
          "cityscapes-panoptic": ("cityscapes", write_cityscapes_panoptic)}


# ----------------------------------------------------------------------------- running blocks
OVERRIDE = re.compile(r"""^['"]?[A-Za-z_][\w.\[\]]*=""")
FIT_CALL = re.compile(r"(?:(?<=\s)|^)(?:visiontrain|[\w./-]+\.py)\s+fit\s+(?P<recipe>\S+)")


def add_fit_args(code: str, extra: str) -> str:
    """Insert ``extra`` after the last ``key=value`` that follows each ``... fit RECIPE``."""
    if not extra:
        return code
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        m = FIT_CALL.search(line)
        if m:
            rest = line[m.end():]
            pos = m.end()
            for tok in re.finditer(r"\S+", rest):
                if not OVERRIDE.match(tok.group()):
                    break
                pos = m.end() + tok.end()
            line = f"{line[:pos]} {extra}{line[pos:]}"
        out.append(line)
    return "\n".join(out) + "\n"


def expected_errors(code: str) -> list[str]:
    return [ln.strip()[2:].strip() for ln in code.splitlines() if ln.strip().startswith("# visiontrain: error:")]


def expected_lines(code: str) -> list[str]:
    """The block's comment lines: under ``prints``, lines its commands print."""
    return [ln.strip()[2:].strip() for ln in code.splitlines() if ln.strip().startswith("# ")]


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def run_chain(chain: Chain, base: Path) -> tuple[bool, str, Path]:
    """Run the chain's blocks in order in a fresh directory; (ok, report, work dir)."""
    work = base / re.sub(r"[^\w.-]", "_", chain.id)
    scripts = base / (work.name + ".scripts")
    work.mkdir(parents=True)
    scripts.mkdir()
    for name, text in page_files(chain.page).items():
        (work / name).write_text(text)
    built: set[str] = set()
    for block in chain.blocks:
        opts = block.options or {}
        for name in filter(None, opts.get("setup", "").split(",")):
            if name not in SETUPS:
                return False, f"{block.where}: unknown setup {name!r} (known: {', '.join(SETUPS)})", work
            if name not in built:
                directory, build = SETUPS[name]
                build(work / directory)
                built.add(name)
        script = scripts / f"block-{block.line}.sh"
        script.write_text(add_fit_args(block.code, opts.get("fit-args", "")))
        want = int(opts.get("exit", 0))
        timeout = float(opts.get("timeout", DEFAULT_TIMEOUT))
        proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", str(script)], cwd=work, env=shell_env(base / "bin"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the block's own process group only
            out, err = proc.communicate()
            return False, (f"{block.where}: did not finish within {timeout:g} s\n--- stdout\n{_tail(out)}"
                           f"\n--- stderr\n{_tail(err)}"), work
        problems = []
        if proc.returncode != want:
            problems.append(f"exited {proc.returncode}, expected {want}")
        if want:
            flat = " ".join(err.split())
            problems += [f"stderr lacks: {msg}" for msg in expected_errors(block.code)
                         if " ".join(msg.split()) not in flat]
        if "prints" in opts:
            flat = " ".join((out + err).split())
            problems += [f"the output lacks: {line}" for line in expected_lines(block.code)
                         if " ".join(line.split()) not in flat]
        if problems:
            return False, (f"{block.where}: {'; '.join(problems)}\n--- stdout\n{_tail(out)}"
                           f"\n--- stderr\n{_tail(err)}"), work
    return True, "", work


class ChainRunner:
    """Runs chains in a small thread pool (each chain is subprocesses), started for every chain
    selected in this session as soon as the first one is asked for."""

    def __init__(self, base: Path, selected: list[str]) -> None:
        self.base, self.selected = base, selected
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, JOBS))
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.lock = threading.Lock()

    def _submit(self, chain_id: str) -> concurrent.futures.Future:
        with self.lock:
            if chain_id not in self.futures:
                self.futures[chain_id] = self.pool.submit(run_chain, CHAINS[chain_id], self.base)
            return self.futures[chain_id]

    def result(self, chain_id: str) -> tuple[bool, str, Path]:
        for cid in self.selected:  # queue everything selected, in collection order
            self._submit(cid)
        return self._submit(chain_id).result()


@pytest.fixture(scope="session")
def chains(tmp_path_factory, request) -> ChainRunner:
    selected = [item.callspec.params["chain_id"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_doc_commands" and hasattr(item, "callspec")]
    runner = ChainRunner(tmp_path_factory.mktemp("docs"), selected)
    yield runner
    runner.pool.shutdown(wait=True)


@pytest.mark.parametrize("chain_id", list(CHAINS))
def test_doc_commands(chains, chain_id):
    ok, report, _ = chains.result(chain_id)
    if not ok:
        pytest.fail(report, pytrace=False)


def test_custom_task_example_learns(chains):
    """The example task of docs/custom-task.md trains to a useful accuracy, not just without error."""
    chain_id = next(cid for cid, c in CHAINS.items() if c.page.name == "custom-task.md")
    ok, report, work = chains.result(chain_id)
    assert ok, report
    summary = json.loads((work / "runs" / "digits-mlp" / "summary.json").read_text())
    assert summary["final"]["top1"] >= 90.0, summary


# ----------------------------------------------------------------------------- static checks
def test_markers_are_well_formed():
    problems = [msg for page in PAGES for msg in stray_markers(page)]
    for page, blocks in BLOCKS.items():
        marked = [b for b in blocks if b.options is not None]
        for b in marked:
            if b.marker_error:
                problems.append(f"{b.where}: {b.marker_error}")
            if b.lang not in ("bash", "sh"):
                problems.append(f"{b.where}: a test marker needs a bash block, not {b.lang or 'an untyped one'!r}")
            for name in filter(None, (b.options or {}).get("setup", "").split(",")):
                if name not in SETUPS:
                    problems.append(f"{b.where}: unknown setup {name!r}")
            if "exit" in (b.options or {}) and not (b.options or {})["exit"].isdigit():
                problems.append(f"{b.where}: exit= needs a number")
            for arg in shlex.split((b.options or {}).get("fit-args", "")):
                if arg.split("=", 1)[0] not in LENGTH_AND_SIZE:  # the reader runs what the page says
                    problems.append(f"{b.where}: fit-args may change the run's length and size only "
                                    f"(tests/support/shipped.py), not {arg}")
        if marked and "continue" in (marked[0].options or {}):
            problems.append(f"{marked[0].where}: the first marked block of a page cannot continue")
    assert not problems, "\n".join(problems)
    assert CHAINS, "no marked blocks found in docs/"


#: A block that is only this runs a small recipe exactly as shipped: tests/app/test_recipes.py runs that.
AS_SHIPPED = re.compile(r"visiontrain fit (" + "|".join(map(re.escape, SMALL_RECIPES)) + r") --run-dir [\w./-]+")


def test_small_recipe_commands_are_marked():
    """Every shell block that trains a small (CPU) recipe runs in this file, but for one that is only
    the recipe as shipped (``visiontrain fit RECIPE --run-dir DIR``), which test_recipes.py runs."""
    pattern = re.compile(r"\bfit\s+(" + "|".join(map(re.escape, SMALL_RECIPES)) + r")(?![\w-])")
    unmarked = [b.where for blocks in BLOCKS.values() for b in blocks
                if b.lang in ("bash", "sh", "") and b.options is None and pattern.search(b.code)
                and not AS_SHIPPED.fullmatch(b.code.strip())]
    assert not unmarked, "unmarked commands that train a small recipe:\n" + "\n".join(unmarked)
    assert AS_SHIPPED.fullmatch("visiontrain fit detect-detr --run-dir runs/detect-detr")
    assert not AS_SHIPPED.fullmatch("visiontrain fit detect-detr data.name=coco --run-dir runs/x")


def test_every_full_recipe_has_a_page():
    from visiontrain.core.config import list_recipes

    assert set(FULL_RECIPES) | set(SMALL_RECIPES) == set(list_recipes()), \
        "a recipe was added or removed: give it a page in docs/recipes/ and update this test"
    for name in FULL_RECIPES:
        page = DOCS / "recipes" / f"{name}.md"
        assert page.is_file(), f"{page} is missing"
        assert page in BLOCKS and any(b.options is not None or AS_SHIPPED.fullmatch(b.code.strip())
                                      for b in BLOCKS[page]), \
            f"{page}: no tested block (its small counterpart's command, marked or as shipped)"
    index = (DOCS / "README.md").read_text()
    missing = [p.relative_to(DOCS).as_posix() for p in PAGES
               if p.name != "README.md" and p.relative_to(DOCS).as_posix() not in index]
    assert not missing, f"docs/README.md does not link: {missing}"


# --- command lines --------------------------------------------------------------
SEPARATORS = {";", "&&", "||", "|", "&", ">", ">>", "<", "2>", "2>&1", "(", ")"}
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")


def shell_commands(code: str) -> list[list[str]]:
    """Simple commands (token lists) of a shell block: continuations joined, comments and heredoc
    bodies dropped, split at ; && || | and redirections."""
    commands: list[list[str]] = []
    lines = code.replace("\\\n", " ").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if (doc := HEREDOC.search(line)):
            while i < len(lines) and lines[i].strip() != doc.group(1):
                i += 1
            i += 1
            line = line[:doc.start()]
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lex.whitespace_split = True
        current: list[str] = []
        for tok in lex:
            if tok in SEPARATORS or set(tok) <= set(";&|<>()"):
                commands.append(current)
                current = []
            else:
                current.append(tok)
        commands.append(current)
    return [c for c in commands if c]


def cli_argv(tokens: list[str], files: dict[str, str]) -> list[str] | None:
    """The visiontrain arguments of a command: after `visiontrain`, `-m visiontrain`, or a page's
    own module that runs the CLI as a script (`python mlp_task.py ...`; a page's other scripts,
    such as docs/inference.md's, take arguments of their own)."""
    for n, tok in enumerate(tokens):
        if tok == "visiontrain" and (n == 0 or tokens[n - 1] not in ("install", "import")):
            return tokens[n + 1:]
        if tok.endswith(".py") and "visiontrain.app.cli" in files.get(tok, ""):
            return tokens[n + 1:]
    return None


def _import_page_module(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(path.stem, module)
    spec.loader.exec_module(module)


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory) -> dict[Path, Path]:
    """Each page's file blocks written out; their Python modules imported (registering tasks)."""
    dirs = {}
    for page in PAGES:
        files = page_files(page)
        d = tmp_path_factory.mktemp(page.stem)
        for name, text in files.items():
            (d / name).write_text(text)
            if name.endswith(".py"):
                _import_page_module(d / name)
        dirs[page] = d
    return dirs


def test_cli_command_lines_parse_and_load(page_dirs):
    """Every `visiontrain ...` line in a shell block (marked or not) parses with the CLI's parser,
    and fit / show-config / benchmark lines load their recipe with their overrides."""
    from visiontrain.app import cli
    from visiontrain.core import config as C

    parser = cli.build_parser()
    problems, seen = [], 0
    for page, blocks in BLOCKS.items():
        files = page_files(page)
        for b in blocks:
            if b.lang not in ("bash", "sh", "shell", "console"):
                continue  # untyped blocks are directory trees and output
            code = add_fit_args(b.code, (b.options or {}).get("fit-args", ""))
            try:
                commands = shell_commands(code)
            except ValueError as err:  # shlex: unbalanced quotes
                problems.append(f"{b.where}: not valid shell: {err}")
                continue
            for tokens in commands:
                argv = cli_argv(tokens, files)
                if argv is None:
                    continue
                seen += 1
                where = f"{b.where}: `{' '.join(tokens)}`"
                stderr = io.StringIO()
                try:
                    with contextlib.redirect_stderr(stderr):
                        args = parser.parse_args(argv)
                except SystemExit:
                    problems.append(f"{where}: {stderr.getvalue().strip().splitlines()[-1]}")
                    continue
                if args.command in ("fit", "show-config", "benchmark"):
                    recipe = args.recipe
                    if recipe in files:
                        recipe = str(page_dirs[page] / recipe)
                    elif recipe not in C.list_recipes():
                        problems.append(f"{where}: recipe {args.recipe!r} is neither built in nor a file of the page")
                        continue
                    try:
                        C.load_config(recipe, args.overrides)
                    except C.ConfigError as err:
                        problems.append(f"{where}: {err}")
                elif args.command == "validate":
                    bad = [k for k, _ in C.parse_overrides(args.overrides) if not key_exists(k)]
                    problems += [f"{where}: unknown config key {k!r}" for k in bad]
    assert seen > 20, f"only {seen} visiontrain command lines found: is the parsing broken?"
    assert not problems, "\n".join(problems)


# --- config keys ------------------------------------------------------------------
SECTIONS = ("seed", *C.SECTIONS)  # seed, task, data, ..., logging: every registered section
KEY = re.compile(r"(?<![\w./-])(?:" + "|".join(SECTIONS) + r")\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
FILE_SUFFIXES = {"py", "pt", "pth", "yaml", "yml", "md", "json", "jsonl", "png", "txt", "safetensors", "onnx",
                 "html", "log", "sh"}
SCHEDULE_TARGETS = ("lr", "weight_decay", "momentum", "ema_decay", "bn_momentum")  # + loss.<term>, task.<scalar>
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
SUBCOMMAND = re.compile(r"(?<![\w./-])(?<!from )(?<!import )visiontrain[ \t]+([a-z][a-z-]*)")


def _field_types(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_mapping(tp: typing.Any) -> bool:
    return typing.get_origin(tp) is dict


def key_exists(key: str) -> bool:
    from visiontrain import catalog
    from visiontrain.core import config as C
    from visiontrain.engine.optim.schedules import ScheduleConfig

    catalog.load()  # every built-in section, as a config loader has them

    parts = key.split(".")
    head, rest = parts[0], parts[1:]
    if head == "seed":
        return not rest
    if head in ("task", "data"):  # typed by their name: a key of any task, of any data source
        fields: dict[str, typing.Any] = {}
        for kind in C.SECTIONS[head].kinds.values():
            fields.update(_field_types(kind))
        if not rest or rest[0] not in fields:
            return False
        return len(rest) == 1 or (len(rest) == 2 and _is_mapping(fields[rest[0]]))
    if head == "schedules":
        if not rest:
            return True
        if rest[0] in ("loss", "task"):
            if len(rest) < 2:
                return False
            rest = rest[2:]
        elif rest[0] in SCHEDULE_TARGETS:
            rest = rest[1:]
        else:
            return False
        return not rest or (len(rest) == 1 and rest[0] in _field_types(ScheduleConfig))
    if head not in C.SECTIONS:
        return False
    cls: typing.Any = C.SECTIONS[head].kind_class({})  # with the keys other modules added (extend_section)
    for n, part in enumerate(rest, 1):
        fields = _field_types(cls)
        if part not in fields:
            return False
        tp = fields[part]
        if dataclasses.is_dataclass(tp):
            cls = tp
            continue
        return n == len(parts) - 1 or (n == len(parts) - 2 and _is_mapping(tp))
    return True


FOREIGN_COLUMN = re.compile(r"flag|cvnets|seamseg", re.I)  # a mapping table's column of the original's names
TABLE_SEPARATOR = re.compile(r"^\s*\|?\s*:?-{3,}")


def _cells(row: str) -> list[str]:
    return re.split(r"(?<!\\)\|", row.strip().strip("|"))


def code_texts(page: Path, *, langs: tuple[str, ...] | None = None) -> list[tuple[int, str]]:
    """(line, text) of every inline code span outside fences and of every fenced line. Table cells
    in a column that holds the original repository's names (its header says flag, cvnets or
    seamseg) are left out: those are not visiontrain keys. ``langs`` limits the
    fenced blocks read to those languages."""
    lines = page.read_text().splitlines()
    out, in_fence, fence, lang, skip = [], False, "", "", []
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line.strip())
        if m and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), m.group("fence")
            lang = m.group("lang") if in_fence else ""
            continue
        if in_fence:
            if langs is None or lang in langs:
                out.append((n, line))
            continue
        texts = [line]
        if line.lstrip().startswith("|"):
            if TABLE_SEPARATOR.match(line):
                continue
            cells = _cells(line)
            if n < len(lines) and TABLE_SEPARATOR.match(lines[n]):  # a header row
                skip = [bool(FOREIGN_COLUMN.search(c)) for c in cells]
            else:
                texts = [c for i, c in enumerate(cells) if not (i < len(skip) and skip[i])]
        else:
            skip = []
        out += [(n, span.group(2)) for text in texts for span in INLINE_CODE.finditer(text)]
    return out


def test_config_keys_written_in_the_docs_exist(page_dirs):
    problems = []
    for page in PAGES:
        for n, text in code_texts(page):
            for m in KEY.finditer(text):
                key = m.group()
                if key.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                    continue  # a file name such as checkpoint.pth or data.yaml
                if text[m.end():m.end() + 2] == ".<":
                    key += ".placeholder"  # a pattern such as schedules.loss.<term>
                if not key_exists(key):
                    problems.append(f"{page.relative_to(ROOT)}:{n}: unknown config key {key!r}")
    assert not problems, "\n".join(problems)


def test_subcommands_written_in_the_docs_exist():
    from visiontrain.app import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    problems = [f"{page.relative_to(ROOT)}:{n}: `visiontrain {m.group(1)}` is not a subcommand "
                f"(known: {', '.join(sub.choices)})"
                for page in PAGES for n, text in code_texts(page, langs=("bash", "sh", ""))
                for m in SUBCOMMAND.finditer(text)
                if m.group(1) not in sub.choices]
    assert not problems, "\n".join(problems)


# --- links --------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(page: Path) -> set[str]:
    anchors, in_fence = set(), False
    for line in page.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def test_links_resolve():
    problems = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    problems.append(f"{page.relative_to(ROOT)}:{n}: link target {target!r} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    problems.append(f"{page.relative_to(ROOT)}:{n}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not problems, "\n".join(problems)


def test_claims_that_once_disagreed_with_the_code():
    """Three sentences a user acted on and found false; each now says what the code does."""
    checkpoints = (DOCS / "checkpoints.md").read_text()
    assert "evaluates the final weights again" not in checkpoints  # a finished run is left as it is
    assert "changes no file" in checkpoints  # tests/app/test_cli.py::test_refuses_to_overwrite_and_resume_auto_continues
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "the gradient norm when `trainer.clip_grad` is set" in readme  # the step computes it only to clip
    from visiontrain.app.commands import _recipe_summary
    from visiontrain.core.config import RECIPES_DIR

    summary = _recipe_summary(RECIPES_DIR / "classify-fashion.yaml")
    quoted = re.search(r"reaches ([\d.]+) % test top-1 in about (\w+) minutes", readme)
    assert quoted and f"{quoted.group(1)} % test top-1 in about {quoted.group(2)} minutes" in summary, summary


def test_the_readme_s_python_script_is_the_one_the_docs_test_runs():
    """README's Python example is docs/custom-task.md's train_digits.py, which a marked block runs as
    a saved file: the README cannot drift from what is tested."""
    readme = (ROOT / "README.md").read_text()
    script = page_files(DOCS / "custom-task.md")["train_digits.py"]
    assert f"```python\n{script}```" in readme or f"```python\n{script}\n```" in readme
