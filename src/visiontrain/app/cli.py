"""The command line: parse it, run the command (``visiontrain.app.commands``), map errors to exit codes
(``visiontrain.core.exit_codes``).

    visiontrain recipes
    visiontrain fit RECIPE|FILE [k=v ...] [--run-dir DIR] [--resume auto|PATH] [--init PATH] [--nproc N]
    visiontrain validate RUN_DIR|CHECKPOINT [k=v ...] [--split val|test]
    visiontrain show-config RECIPE|FILE [k=v ...] [--docs]
    visiontrain preview RECIPE|FILE [k=v ...] [--out DIR]
    visiontrain predict CHECKPOINT|MODEL.onnx IMAGE... --out DIR [--top-k K] [--sheet] [--threshold T] [--ema]
                        [--device D] [--tile S [--tile-overlap F] [--no-whole-image]]
    visiontrain export CHECKPOINT --format onnx|exported-program|torchscript [--out FILE] [--ema]
    visiontrain consolidate CHECKPOINT [--out FILE]
    visiontrain benchmark RECIPE|FILE [k=v ...] [--steps N] [--warmup N] [--synthetic] [--init PATH]
    visiontrain compare RUN_DIR RUN_DIR ... [--out FILE.png] [--metrics M ...]
    visiontrain report RUN_DIR [--out FILE.html]
    visiontrain shard RECIPE|FILE [k=v ...] --out DIR [--shard-size 1GB] [--splits train,val,test]
    visiontrain tile RECIPE|FILE [k=v ...] --out DIR --size S [--overlap F] [--min-visibility V] [--keep-empty F]
    visiontrain tune RECIPE|FILE --space SPACE.yaml --trials N --study-dir DIR [k=v ...] [--jobs K] [--pruner P]
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import yaml

from visiontrain.core import config as C
from visiontrain.app.commands import (cmd_benchmark, cmd_compare, cmd_consolidate, cmd_export, cmd_fit, cmd_predict,
                                      cmd_preview, cmd_recipes, cmd_report, cmd_shard, cmd_show_config, cmd_tile,
                                      cmd_tune, cmd_validate)
from visiontrain.rundir.write_failure import WriteError
from visiontrain.core.exit_codes import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY, EXIT_PEER_LOST, EXIT_USAGE
from visiontrain.catalog import import_user
from visiontrain.app.launch import command_line
from visiontrain.core.process_tree import skip_final_collection
from visiontrain.core.stop_signals import Preempted


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it has none worth saying (None, False, [])."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, []) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def _version() -> str:
    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"
    return f"visiontrain {of('visiontrain')} (torch {of('torch')}, torchvision {of('torchvision')}, timm {of('timm')})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="visiontrain", description="Train vision models from recipes.",
                                formatter_class=_Help)
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import your module first, so that the tasks it registers exist: a module name "
                        "(found from the current directory too) or a path to a .py file; repeatable; "
                        "passed on to every rank of --nproc")
    sub = p.add_subparsers(dest="command", required=True, parser_class=lambda **kw: argparse.ArgumentParser(
        formatter_class=_Help, **kw))
    _add_training_commands(sub)
    _add_model_commands(sub)
    _add_run_tools(sub)
    return p


def _add_training_commands(sub: Any) -> None:
    """recipes, fit, validate: what trains a recipe and evaluates what it trained."""
    sub.add_parser("recipes", help="list built-in recipes").set_defaults(fn=cmd_recipes)

    fit = sub.add_parser("fit", help="train a recipe")
    fit.add_argument("recipe", help="built-in recipe name or path to a YAML file")
    fit.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=3e-4")
    fit.add_argument("--run-dir", help="output directory (default runs/<recipe>)")
    fit.add_argument("--resume", help="'auto' (the run dir's last.pt if there is one, else a new run), a "
                                      "checkpoint, or a run dir (its last.pt)")
    fit.add_argument("--init", help="load weights only, from a checkpoint or a run dir (best.pt, else last.pt); "
                                    "tensors of another shape are skipped")
    fit.add_argument("--nproc", type=int, help="launch N processes on this machine through torchrun "
                                               "(one per GPU; gloo on CPU)")
    fit.set_defaults(fn=cmd_fit)

    val = sub.add_parser("validate", help="evaluate a run dir's best (else last) checkpoint or a file")
    val.add_argument("target", help="RUN_DIR or CHECKPOINT")
    val.add_argument("overrides", nargs="*", help="key=value overrides (e.g. data.root=...)")
    val.add_argument("--split", choices=["val", "test"], default="val",
                     help="val: the split validated during training; test: data.test_split, which training never "
                          "touched (detection datasets)")
    val.set_defaults(fn=cmd_validate)
    _add_tune(sub)


def _add_tune(sub: Any) -> None:
    tune = sub.add_parser("tune", help="search a recipe's settings with Optuna: each trial a fit in the study dir, "
                                       "the study in a database that outlives the tuner (docs/tuning.md)")
    tune.add_argument("recipe", help="built-in recipe name or path to a YAML file")
    tune.add_argument("overrides", nargs="*", help="key=value overrides applied to every trial")
    tune.add_argument("--space", required=True, help="YAML file: config keys and their distributions, e.g. "
                                                     "'optim.lr: {log: [1.0e-4, 1.0e-2]}'")
    tune.add_argument("--trials", type=int, required=True, help="the study's number of trials, all tuners together "
                                                                "(a restarted tuner runs only those missing)")
    tune.add_argument("--study-dir", required=True, help="the study's directory: its trials' run dirs, study.db "
                                                         "(unless --storage), study.json, trials.csv, best.yaml, "
                                                         "plots and report.html")
    tune.add_argument("--storage", help="an SQLAlchemy URL of the study's database, shared by tuners on several "
                                        "machines (postgresql://USER:PASSWORD@HOST/DB); default "
                                        "sqlite:///STUDY_DIR/study.db")
    tune.add_argument("--study-name", help="the study's name in the storage (default: the study dir's name)")
    tune.add_argument("--jobs", type=int, default=1, help="trials run at once by this tuner, each with its share "
                                                          "of the CPU threads")
    tune.add_argument("--pruner", default="median", choices=["median", "halving", "none"],
                      help="stop trials that fall behind at an evaluation: median (of earlier trials at that step, "
                           "after 2 trials) or halving (successive halving)")
    tune.add_argument("--metric", help="the objective (default: the recipe's eval.metric, else the task's); sets "
                                       "eval.metric in every trial")
    tune.add_argument("--seed", type=int, help="the sampler's seed, offset by the trials the study already has (a "
                                               "continued study draws new values); give two tuners sharing a "
                                               "study different seeds, or none. The trials' own seed is the "
                                               "recipe's")
    tune.set_defaults(fn=cmd_tune)


def _add_model_commands(sub: Any) -> None:
    """predict, export, consolidate: what a trained checkpoint is used for."""
    pred = sub.add_parser("predict", help="a classifier's top-k classes (JSON, optional contact sheet), a "
                                          "detector's boxes (drawn, and a COCO JSON), a segmenter's label maps or "
                                          "panoptic segments (PNGs, overlays, JSON) on image files")
    pred.add_argument("checkpoint", help="a classification, detection or segmentation checkpoint, a run dir (its "
                                         "best.pt, else last.pt), or an .onnx file visiontrain export wrote (run by "
                                         "onnxruntime)")
    pred.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    pred.add_argument("--out", required=True, help="output directory: predictions.json (and sheet.png) for a "
                                                   "classifier; one drawing per image and detections.json for a "
                                                   "detector; label PNGs, overlays and segmentation.json for a "
                                                   "semantic segmenter; COCO panoptic PNGs, overlays and "
                                                   "panoptic.json for a panoptic one")
    pred.add_argument("--top-k", type=int, default=None,
                      help="classification: classes written per image (default 5, or the class count if lower)")
    pred.add_argument("--sheet", action="store_true",
                      help="classification: also write OUT/sheet.png, each image with its top class and probability")
    pred.add_argument("--threshold", type=float, default=None,
                      help="detection: minimum score drawn and written (default: the task's; 0.3 for a DETR trained "
                           "with a focal or varifocal loss, 0.5 otherwise)")
    pred.add_argument("--tile", type=int, default=None,
                      help="detection: sliced prediction for large images: run on overlapping S x S tiles (the "
                           "grid of `visiontrain tile`) and on the whole image, boxes and masks merged back")
    pred.add_argument("--tile-overlap", type=float, default=0.2, help="with --tile: the share of a tile its "
                                                                      "neighbour overlaps, in [0, 1)")
    pred.add_argument("--no-whole-image", action="store_true", help="with --tile: run on the tiles only, not on "
                                                                    "the whole image too")
    pred.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")
    pred.add_argument("--device", default=None, help="where the model runs, e.g. cpu, cuda, cuda:1 (default: the "
                                                     "GPU if there is one)")
    pred.set_defaults(fn=cmd_predict)

    exp = sub.add_parser("export", help="write a checkpoint's network as ONNX / ExportedProgram / TorchScript "
                                        "and compare it with PyTorch")
    exp.add_argument("checkpoint", help="a checkpoint, or a run dir (its best.pt, else last.pt)")
    exp.add_argument("--format", required=True, choices=["onnx", "exported-program", "torchscript"],
                     help="onnx (checked in onnxruntime), exported-program (torch.export) or torchscript")
    exp.add_argument("--out", help="output file (default: the checkpoint path with the format's suffix)")
    exp.add_argument("--ema", action="store_true", help="export the checkpoint's EMA weights")
    exp.set_defaults(fn=cmd_export)

    cons = sub.add_parser("consolidate", help="turn a sharded (FSDP) checkpoint into a single file")
    cons.add_argument("checkpoint", help="a .pt file of an FSDP run, e.g. RUN_DIR/checkpoints/last.pt")
    cons.add_argument("--out", help="output file (default: CHECKPOINT's name with -full.pt)")
    cons.set_defaults(fn=cmd_consolidate)


def _add_run_tools(sub: Any) -> None:
    """benchmark, compare, report, preview, show-config: looking at a recipe or at runs, training nothing."""
    bench = sub.add_parser("benchmark", help="time training steps of a recipe: samples/s, data wait vs "
                                             "compute, peak memory (writes nothing)")
    bench.add_argument("recipe", help="built-in recipe name or path to a YAML file")
    bench.add_argument("overrides", nargs="*", help="key=value overrides")
    bench.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    bench.add_argument("--synthetic", action="store_true", help="replay the first batch: compute only")
    bench.add_argument("--init", metavar="PATH", help="start from these weights (a checkpoint or .safetensors, as "
                                                      "fit --init): a trained detector's step costs more")
    bench.set_defaults(fn=cmd_benchmark)

    comp = sub.add_parser("compare", help="runs side by side: a metrics table and their curves on shared axes")
    comp.add_argument("runs", nargs="+", help="run dirs (each with the metrics.jsonl of a `visiontrain fit`)")
    comp.add_argument("--out", default="compare.png", help="the figure (PNG) to write")
    comp.add_argument("--metrics", nargs="*", help="evaluation metrics to plot (default: every one the runs share)")
    comp.set_defaults(fn=cmd_compare)

    rep = sub.add_parser("report", help="one self-contained HTML page for a run: config, metrics, "
                                        "throughput and every plot")
    rep.add_argument("run_dir", help="a run dir (the --run-dir of a `visiontrain fit`, finished or not)")
    rep.add_argument("--out", help="the HTML file to write (default RUN_DIR/report.html)")
    rep.set_defaults(fn=cmd_report)

    shard = sub.add_parser("shard", help="write a recipe's data (or data.* overrides) as tar shards to train from "
                                         "(data.name=shards): each image's bytes as they were, its labels, an index")
    shard.add_argument("recipe", help="built-in recipe name or path to a YAML file (its data section is read)")
    shard.add_argument("overrides", nargs="*", help="key=value overrides (data.name=..., data.root=...)")
    shard.add_argument("--out", required=True, help="the directory or URL (s3://..., gs://...) of the shards and "
                                                   "their index.json; a killed write to it continues where it stopped")
    shard.add_argument("--staging", help="--out URL: the local directory each file is written in before it is "
                                         "uploaded (default: one per URL in the temporary directory)")
    shard.add_argument("--shard-size", default="1GB", help="about how large each shard is: bytes, or with a unit "
                                                          "(500MB, 1GB, 256MiB)")
    shard.add_argument("--splits", help="which splits to write, comma-separated, train first: train,val,test "
                                        "(data.train_split, data.val_split, data.test_split); default train and val, "
                                        "and test where the source has it")
    shard.set_defaults(fn=cmd_shard)
    _add_tile(sub)

    prev = sub.add_parser("preview", help="draw a recipe's first training batch (train_batch.png) and its "
                                          "training labels (labels.png, detection) without training")
    prev.add_argument("recipe", help="built-in recipe name or path to a YAML file")
    prev.add_argument("overrides", nargs="*", help="key=value overrides")
    prev.add_argument("--out", help="output directory (default runs/<recipe>-preview)")
    prev.set_defaults(fn=cmd_preview)

    show = sub.add_parser("show-config", help="print the resolved config")
    show.add_argument("recipe", help="built-in recipe name or path to a YAML file")
    show.add_argument("overrides", nargs="*", help="key=value overrides")
    show.add_argument("--docs", action="store_true", help="list every key with its type and meaning")
    show.set_defaults(fn=cmd_show_config)


def _add_tile(sub: Any) -> None:
    tile = sub.add_parser("tile", help="cut a recipe's detection data (or data.* overrides) into overlapping tiles "
                                       "with their boxes and masks, written as COCO (data.name=coco data.root=OUT)")
    tile.add_argument("recipe", help="built-in recipe name or path to a YAML file (its data section is read; masks "
                                     "are cut where its task trains on them, e.g. segment-mask-rcnn)")
    tile.add_argument("overrides", nargs="*", help="key=value overrides (data.name=..., data.root=...)")
    tile.add_argument("--out", required=True, help="the directory written: OUT/annotations/instances_<split>.json "
                                                   "and OUT/<split>/<image>__x<X>_y<Y>.<ext>")
    tile.add_argument("--size", type=int, required=True, help="the tiles' side in pixels (an image smaller than "
                                                              "that is one tile, as it is)")
    tile.add_argument("--overlap", type=float, default=0.2, help="the share of a tile its neighbour overlaps, in "
                                                                 "[0, 1); the last tile of a row or column ends at "
                                                                 "the image's edge")
    tile.add_argument("--min-visibility", type=float, default=0.3,
                      help="the share of a box's area a tile must show for the box to be kept (clipped to the tile)")
    tile.add_argument("--keep-empty", type=float, default=0.1,
                      help="the share of the train split's tiles without an object that are kept (the same ones "
                           "every time); the other splits keep every tile")
    tile.add_argument("--splits", help="which splits to cut, comma-separated, train first: train,val,test "
                                       "(data.train_split, data.val_split, data.test_split); default train and val, "
                                       "and test where the source has it")
    tile.set_defaults(fn=cmd_tile)


def main(argv: list[str] | None = None) -> int:
    """The command line ``visiontrain ...`` (``argv`` None: this process is the command, and ends
    as one, ``skip_final_collection``), or ``argv`` from a Python caller, whose process it is."""
    if argv is None:
        skip_final_collection()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if hasattr(sys.stdout, "reconfigure"):  # a class name a stdout cannot encode (ASCII) is escaped, not an error
        sys.stdout.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # key=value after an option: `validate RUN --split test data.root=...`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from visiontrain.engine.parallel.distributed import PeerLost
    from visiontrain.engine.state.checkpoint import CheckpointError
    from visiontrain.engine.step.guards import NonFiniteLossError, OutOfMemory
    from visiontrain.models import PretrainedUnavailable

    args.command_line = command_line(sys.argv[1:] if argv is None else argv)  # recorded in provenance.json
    try:
        for module in args.imports:
            import_user(module)
        return args.fn(args)
    except Preempted as err:
        print(f"visiontrain: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # a Ctrl-C during set-up, or a second one while a run stops
        print("visiontrain: interrupted by Ctrl-C: stopped at once (checkpoints written before are complete)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except NonFiniteLossError as err:
        print(f"visiontrain: error: {err}", file=sys.stderr)
        return EXIT_NONFINITE
    except OutOfMemory as err:
        print(f"visiontrain: error: {err}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except PeerLost as err:
        print(f"visiontrain: error: {err}", file=sys.stderr)
        return EXIT_PEER_LOST
    except (C.ConfigError, CheckpointError, WriteError, FileNotFoundError, ValueError, yaml.YAMLError,
            PretrainedUnavailable) as err:
        print(f"visiontrain: error: {_one_line(err)}", file=sys.stderr)
    # Outside the except block the error (and its frames, which hold the trainer and its DataLoader
    # iterator) is gone: collect it now, while the workers still run, rather than at interpreter
    # exit, when torch would report them as killed with a second traceback.
    gc.collect()
    return EXIT_USAGE


def _one_line(err: BaseException) -> str:
    """An error raised in a DataLoader worker arrives as 'Caught X in DataLoader worker process N.
    Original Traceback ...'; the user needs its own message, the last line."""
    text = str(err)
    if text.startswith("Caught ") and "Original Traceback" in text:
        return text.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return text
