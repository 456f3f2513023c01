"""What each command of the CLI does: load the config or the checkpoint, call the engine or the app
module that does the work, print the result (one JSON line for a program to read). Parsing the
command line and turning errors into exit codes is ``visiontrain.app.cli``'s.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from visiontrain.app.launch import elastic_store_hint, end_with_launcher, run_torchrun
from visiontrain.core import config as C
from visiontrain.core.exit_codes import EXIT_USAGE
from visiontrain.core.stop_signals import Preempted, ignore_stop_signals
from visiontrain.data.shards.layout import parse_size
from visiontrain.engine.protocols.hooks import load_hooks
from visiontrain.engine.records.provenance import Launch
from visiontrain.engine.records.run_log import class_table_text, dumps_json
from visiontrain.engine.records.tracking import FINISHED, end_trackers, make_trackers, status_of
from visiontrain.report.compare import compare, config_diff
from visiontrain.report.page import write_report
from visiontrain.rundir.checkpoint_format import model_weights, sharded_record, step_of
from visiontrain.rundir.metrics_file import per_class_tables
from visiontrain.rundir.run_files import CHECKPOINTS_DIR, LAST_CHECKPOINT, REPORT_FILE
from visiontrain.rundir.run_lock import check_free, held


def print_json(value: Any) -> None:
    """The one JSON line a command prints for a program to read. Names stay as written ("Müll",
    "树"), not \\u escapes; escaped only where stdout cannot encode them (an ASCII locale)."""
    text = dumps_json(value, ensure_ascii=False)
    try:
        text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
    except UnicodeEncodeError:
        text = dumps_json(value)
    print(text)


def _recipe_summary(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def cmd_recipes(_: argparse.Namespace) -> int:
    names = C.list_recipes()
    width = max(len(n) for n in names)
    for name in names:
        print(f"{name:<{width}}  {_recipe_summary(C.RECIPES_DIR / f'{name}.yaml')}")
    return 0


def cmd_show_config(args: argparse.Namespace) -> int:
    cfg = C.load_config(args.recipe, args.overrides)
    if args.docs:
        rows = C.describe_keys(cfg)
        key_w, type_w = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
        for key, tp, text in rows:
            print(f"{key:<{key_w}}  {tp:<{type_w}}  {text}")
    else:
        print(C.dump_config(cfg), end="")
    return 0


def _default_run_dir(recipe: str) -> Path:
    return Path("runs") / Path(recipe).stem


def cmd_fit(args: argparse.Namespace) -> int:
    from visiontrain.engine.state.run_dir import checkpoint_in, resolve_resume

    cfg = C.load_config(args.recipe, args.overrides)  # errors surface here, before any process starts
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(args.recipe)
    torchrun = args.nproc is not None and args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1
    rank0 = os.environ.get("RANK", "0") == "0"
    end_with_launcher()  # a rank of torchrun: end with its agent, however that one dies
    if (hint := elastic_store_hint(dict(os.environ))) is not None:
        print(hint, file=sys.stderr)
    # rank 0's trackers (MLflow): a missing package or a bad URI is an error now, before any process starts
    trackers = make_trackers(cfg, run_dir, args.recipe)
    load_hooks(cfg.trainer.hooks)  # a trainer.hooks entry that is no hook, too
    init = str(checkpoint_in(args.init)) if args.init else None
    if torchrun:
        check_free(run_dir)  # a run dir in use is refused before torchrun starts; rank 0 then locks it
        resolve_resume(run_dir, args.resume, is_main=False)  # and a run dir it would refuse (nothing moved)
        return run_torchrun(args)
    with held(run_dir, enabled=rank0) as lock:  # one writer per run dir, until the report is written
        for note in lock.notes:
            print(f"visiontrain: {note}", file=sys.stderr)
        summary, done = _train(cfg, run_dir, args, args.resume, init, trackers)
        if summary:  # rank 0 of a run with a run dir
            report = (str(run_dir / REPORT_FILE) if (run_dir / REPORT_FILE).is_file() else None) if done \
                else _final_report(run_dir)
            print_json({"run_dir": str(run_dir), "report": report, **summary})
        end_trackers(trackers, FINISHED)  # after the report: it reaches the tracker with the final status
    return 0


def _train(cfg: C.Config, run_dir: Path, args: argparse.Namespace, resume: str | None, init: str | None,
           trackers: list[Any]) -> tuple[dict[str, Any], bool]:
    """Build the trainer and fit (or find the run already finished); leave the process group."""
    from visiontrain.engine.loop.trainer import Trainer
    from visiontrain.engine.parallel.distributed import PeerLost, lost_peer, shutdown
    from visiontrain.engine.state.checkpoint import removed_if_set_up_fails
    from visiontrain.tasks import build_task

    try:
        with removed_if_set_up_fails(run_dir):
            trainer = Trainer(cfg, build_task(cfg), run_dir, resume=resume, init=init, trackers=trackers,
                              launch=Launch(args.recipe, list(args.overrides), args.command_line))
        summary = trainer.fit()  # a run resumed at its end trains nothing (trainer.nothing_to_train)
        done = trainer.nothing_to_train
        del trainer
    except Preempted as err:
        err = err.with_traceback(None)  # its frames hold the trainer (and DDP): drop them before shutdown
        shutdown()  # every rank stopped at the same, agreed step
        raise err
    except BaseException as err:
        lost = lost_peer(err)
        if lost:  # torchrun's agent SIGTERMs the ranks left when one dies: this one says why first
            ignore_stop_signals()
        end_trackers(trackers, status_of(err))  # fit ended them already if it raised: this does nothing then
        shutdown(barrier=False)  # other ranks may be gone: leave without waiting for them
        if lost:
            raise PeerLost(_peer_lost(err, run_dir)) from None
        raise
    shutdown()
    return summary, done


def _peer_lost(err: BaseException, run_dir: Path) -> str:
    """What a rank says when another rank or node is gone: what failed, what is safe, what to do."""
    from visiontrain.engine.state.checkpoint import CheckpointError, load_checkpoint

    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    reason = reason.split("] ", 1)[-1].split(". This is typically", 1)[0][:200]  # gloo's source path and advice go
    last = run_dir / CHECKPOINTS_DIR / LAST_CHECKPOINT
    try:
        kept = f"{last} at step {step_of(load_checkpoint(last, resolve_sharded=False, mmap=True))} is intact"
    except CheckpointError:
        kept = f"no checkpoint on this node yet ({last})"
    rank = os.environ.get("RANK", "?")
    return (f"rank {rank} lost another rank of the run ({reason}): a rank or node was killed, crashed or became "
            f"unreachable; {kept}; restart every node with --resume auto")


def _final_report(run_dir: Path) -> str | None:
    """RUN_DIR/report.html at the end of every fit. The run is done and saved by now: a report
    that cannot be written is a warning, not a failed run (``visiontrain report`` can retry)."""
    try:
        return str(write_report(run_dir, as_trained=True)[0])
    except Exception as err:  # noqa: BLE001
        print(f"visiontrain: warning: no report written to {run_dir}: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def cmd_preview(args: argparse.Namespace) -> int:
    from visiontrain.engine.records.first_look import preview
    from visiontrain.tasks import build_task

    cfg = C.load_config(args.recipe, args.overrides)
    out = Path(args.out) if args.out else Path("runs") / f"{Path(args.recipe).stem}-preview"
    written = preview(cfg, build_task(cfg), out)
    print_json({"recipe": args.recipe, "out": str(out), "plots": [str(p) for p in written]})
    return 0


@contextlib.contextmanager
def shard_progress(total: int, label: str = "shard") -> Iterator[Callable[[int], None]]:
    """``advance(n)`` for a rich progress bar over the samples on a terminal, named ``label``;
    elsewhere nothing to draw (each finished shard's or split's line says how far the write is)."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
        task = bar.add_task("samples", total=total)
        yield lambda n: bar.advance(task, n)


def labels_for(task_name: str) -> tuple[str | None, bool]:
    """What a shard written from a recipe carries for its task: the labels of the task's family
    (``semantic``, ``panoptic``; None: the source's own), by what the task predicts (``Task.predicts``),
    and whether each object's mask (``reads_masks``: Mask R-CNN, Panoptic FPN). fashion-mosaic has
    boxes, masks, label maps and panoptic PNGs: the recipe says which a run from the shards reads."""
    from visiontrain.engine.protocols.task import Prediction, registered_task

    task_class = registered_task(task_name).task_class
    family = {Prediction.LABEL_MAP: "semantic", Prediction.PANOPTIC: "panoptic"}.get(task_class.predicts)
    return family, bool(getattr(task_class, "reads_masks", False))


def cmd_shard(args: argparse.Namespace) -> int:
    from visiontrain.data.shards.raw import raw_data
    from visiontrain.data.shards.writer import write_shards_to

    shard_size = parse_size(args.shard_size)  # a bad size fails before the data is read
    cfg = C.load_config(args.recipe, args.overrides)
    family, masks = labels_for(cfg.task.name)
    raw, lines = raw_data(cfg.data, args.splits.split(",") if args.splits else None, masks=masks, labels=family)
    for line in lines:
        print(f"visiontrain: {line}", file=sys.stderr)
    out = args.out
    with shard_progress(sum(split.count for split in raw.splits)) as advance:
        index = write_shards_to(raw, out, shard_size, C.config_to_dict(cfg)["data"], advance,
                                staging=Path(args.staging) if args.staging else None)
    splits = {name: {"samples": e["samples"], "shards": len(e["shards"]), "bytes": sum(s["bytes"] for s in e["shards"])}
              for name, e in index["splits"].items()}
    print_json({"out": str(out), "kind": index["kind"], "classes": len(index["class_names"]), "splits": splits})
    return 0


def cmd_tile(args: argparse.Namespace) -> int:
    """A detection source's splits cut into overlapping tiles, written as COCO (``data/detection/tiled_coco.py``);
    masks where the recipe's task trains on them."""
    from visiontrain.data.detection.sources import DETECTION_SOURCES, DetectionDataConfig
    from visiontrain.data.detection.tiled_coco import TileOptions, write_tiles
    from visiontrain.data.shards.raw import raw_data

    options = TileOptions(args.size, args.overlap, args.min_visibility, args.keep_empty)
    options.check()  # a bad option fails before the data is read
    cfg = C.load_config(args.recipe, args.overrides)
    if not isinstance(cfg.data, DetectionDataConfig):
        raise C.ConfigError(f"data.name={cfg.data.name}: visiontrain tile cuts the boxes and masks of a detection "
                            f"source ({', '.join(DETECTION_SOURCES)}) with its images; this one it cannot read")
    masks = labels_for(cfg.task.name)[1]
    raw, lines = raw_data(cfg.data, args.splits.split(",") if args.splits else None, masks=masks)
    for line in lines:
        print(f"visiontrain: {line}", file=sys.stderr)
    with shard_progress(sum(split.count for split in raw.splits), "tile") as advance:
        splits = write_tiles(raw, Path(args.out), options, cfg.data.train_split, advance)
    for name, counts in splits.items():
        print(f"visiontrain: {name}: {counts['images']} images -> {counts['tiles']} tiles with {counts['boxes']} "
              f"objects ({counts['empty_tiles_left_out']} tiles without an object left out)", file=sys.stderr)
    print_json({"out": args.out, "size": options.size, "overlap": options.overlap, "masks": masks,
                "classes": len(raw.class_names), "splits": splits})
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from visiontrain.engine.parts.evaluator import evaluate_models
    from visiontrain.engine.setup.training import build_evaluation
    from visiontrain.use.trained import load_trained

    trained = load_trained(args.target, args.overrides, split=args.split)
    ema = trained.model(ema=True) if trained.has_ema else None
    run = build_evaluation(trained.cfg, trained.task, trained.model(), ema, trained.info)
    metrics = evaluate_models(run, trained.cfg.eval.models)
    for key, table in per_class_tables(metrics).items():  # for a person; the JSON line below holds them too
        print(class_table_text(key, table))
    split = {"split": args.split, "data_split": trained.cfg.data.val_split} if args.split == "test" else {}
    print_json({"checkpoint": trained.path, "step": trained.step, **split, **metrics})
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """A classifier's top-k classes (predictions.json, --sheet: sheet.png), a detector's boxes
    (drawings and detections.json) or a semantic segmenter's label maps (PNGs, overlays and
    segmentation.json), through the Python API (``visiontrain.use.inference``)."""
    from visiontrain.engine.protocols.task import Prediction
    from visiontrain.use.predict import (classify_images, load_predictor, panoptic_images, predict_images,
                                         segment_images)

    if args.top_k is not None and args.top_k < 1:
        raise C.ConfigError(f"--top-k: must be an integer >= 1 (classes written per image), got {args.top_k}")
    predictor = load_predictor(args.checkpoint, ema=args.ema, device=args.device)
    out, what = Path(args.out), f"{predictor.checkpoint} is a {predictor.task_name} model"
    if predictor.prediction is Prediction.BOXES:
        if args.top_k is not None or args.sheet:
            raise C.ConfigError(f"--top-k and --sheet apply to classification checkpoints; {what} "
                                f"(a detector: its drawings are written, --threshold sets their minimum score)")
        written = predict_images(predictor, args.images, out, score_threshold=args.threshold, tile=args.tile,
                                 tile_overlap=args.tile_overlap, whole_image=not args.no_whole_image)
        print_json({"out": args.out, "images": len(args.images), "detections": written})
        return 0
    if predictor.prediction is Prediction.LABEL_MAP:
        if args.top_k is not None or args.sheet or args.threshold is not None or args.tile is not None:
            raise C.ConfigError(f"--top-k, --sheet, --threshold and --tile apply to classification and detection "
                                f"checkpoints; {what} (a semantic segmenter: its label maps and overlays are written)")
        print_json({"out": args.out, "images": len(args.images), **segment_images(predictor, args.images, out)})
        return 0
    if predictor.prediction is Prediction.PANOPTIC:
        if args.top_k is not None or args.sheet or args.threshold is not None or args.tile is not None:
            raise C.ConfigError(f"--top-k, --sheet, --threshold and --tile apply to classification and detection "
                                f"checkpoints; {what} (a panoptic segmenter: its id PNGs, overlays and COCO "
                                f"panoptic JSON are written)")
        print_json({"out": args.out, "images": len(args.images), **panoptic_images(predictor, args.images, out)})
        return 0
    if args.threshold is not None:
        raise C.ConfigError(f"--threshold applies to detection checkpoints; {what} (a classifier: --top-k)")
    if args.tile is not None:
        raise C.ConfigError(f"--tile applies to detection checkpoints; {what} (a classifier takes each image whole)")
    written = classify_images(predictor, args.images, out, top_k=args.top_k, sheet=args.sheet)
    print_json({"out": args.out, "images": len(args.images), **written})
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from visiontrain.engine.protocols.task import ExportUnsupported
    from visiontrain.use.export import export_checkpoint

    try:
        result = export_checkpoint(args.checkpoint, args.format, args.out, use_ema=args.ema)
    except ExportUnsupported as err:
        print(f"visiontrain: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print_json(result)
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from visiontrain.engine.state.checkpoint import CheckpointError, atomic_save, load_checkpoint

    src = Path(args.checkpoint)
    if sharded_record(load_checkpoint(src, resolve_sharded=False, mmap=True)) is None:
        raise CheckpointError(f"{src} is already a single-file checkpoint (it names no sharded directory); "
                              f"validate, predict, export and --init read it as it is")
    state = load_checkpoint(src)  # the sharded tensors, gathered whole in this one process
    out = Path(args.out) if args.out else src.with_name(f"{src.stem}-full.pt")
    atomic_save(state, out)
    print_json({"checkpoint": str(src), "out": str(out), "tensors": len(model_weights(state)),
                "bytes": out.stat().st_size})
    return 0


def cmd_benchmark(args: argparse.Namespace) -> int:
    from visiontrain.app.benchmark import format_report, run_benchmark
    from visiontrain.engine.parallel.distributed import shutdown
    from visiontrain.tasks import build_task

    cfg = C.load_config(args.recipe, args.overrides)
    try:
        result = run_benchmark(cfg, build_task(cfg), steps=args.steps, warmup=args.warmup, synthetic=args.synthetic,
                               init=args.init)
    finally:
        shutdown(barrier=False)
    print(format_report(args.recipe, result))
    print_json({"recipe": args.recipe, **result})
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    out = Path(args.out)
    tables = [("runs side by side (metrics: the last evaluation)", compare(args.runs, out, args.metrics)),
              ("config keys that differ", config_diff(args.runs))]
    console = Console(width=max(120, 14 * len(tables[0][1][0])))
    for title, (columns, rows) in tables:
        if rows:  # equal configs: no second table
            table = Table(*columns, title=title)
            for row in rows:
                table.add_row(*row)
            console.print(table)
    print(f"curves on shared axes: {out}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    path, plots = write_report(args.run_dir, args.out)
    print_json({"run_dir": args.run_dir, "report": str(path), "plots": plots, "bytes": path.stat().st_size})
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from visiontrain.tune.outputs import after_trial, summary_text, write_outputs
    from visiontrain.tune.study import TuneSettings, prepare, run_search

    settings = TuneSettings(recipe=args.recipe, space=args.space, trials=args.trials, study_dir=Path(args.study_dir),
                            overrides=list(args.overrides), storage=args.storage, study_name=args.study_name,
                            jobs=args.jobs, pruner=args.pruner, metric=args.metric, seed=args.seed,
                            imports=list(args.imports))
    search = prepare(settings)  # a bad space, key, value or study: an error before any trial starts
    search.after_trial = lambda trial, outcome, run_dir: after_trial(search, trial, outcome, run_dir)
    try:
        run_search(search)
    finally:
        summary = write_outputs(search, plots=True)
        print(summary_text(search, summary), file=sys.stderr)
    print_json({"study_dir": str(settings.study_dir), "study": summary["study"], "counts": summary["counts"],
                "best": summary["best"], "report": str(settings.study_dir / REPORT_FILE)})
    return 0
