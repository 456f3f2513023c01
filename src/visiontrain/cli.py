"""The command line: parse, load the config, call the engine. Nothing else lives here.

    visiontrain recipes
    visiontrain fit RECIPE|FILE [k=v ...] [--run-dir DIR] [--resume auto|PATH] [--init PATH] [--nproc N]
    visiontrain validate RUN_DIR|CHECKPOINT [k=v ...]
    visiontrain show-config RECIPE|FILE [k=v ...] [--docs]
    visiontrain predict CHECKPOINT IMAGE... --out DIR [--threshold T] [--ema]
    visiontrain export CHECKPOINT --format onnx|exported-program|torchscript [--out FILE] [--ema]
    visiontrain consolidate CHECKPOINT [--out FILE]
    visiontrain benchmark RECIPE|FILE [k=v ...] [--steps N] [--warmup N] [--synthetic]
    visiontrain compare RUN_DIR RUN_DIR ... [--out FILE.png] [--metrics M ...]
    visiontrain report RUN_DIR [--out FILE.html]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from visiontrain import config as C
from visiontrain.engine.logging import dumps_json

EXIT_USAGE, EXIT_NONFINITE = 2, 3  # and engine.preemption: 4 preempted, 130 Ctrl-C (last.pt written: resume)
EXIT_OUT_OF_MEMORY = 5


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
    from visiontrain.engine.checkpoint import removed_if_set_up_fails
    from visiontrain.engine.distributed import shutdown
    from visiontrain.engine.provenance import Launch
    from visiontrain.engine.run_dir import checkpoint_in, resolve_resume
    from visiontrain.engine.tracking import FINISHED, end_trackers, make_trackers, status_of
    from visiontrain.launch import exec_torchrun
    from visiontrain.engine.preemption import Preempted
    from visiontrain.engine.trainer import Trainer
    from visiontrain.tasks import build_task

    cfg = C.load_config(args.recipe, args.overrides)  # errors surface here, before any process starts
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(args.recipe)
    torchrun = args.nproc is not None and args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1
    rank0 = os.environ.get("RANK", "0") == "0"
    # rank 0's trackers (MLflow): a missing package or a bad URI is an error now, before any process starts
    trackers = make_trackers(cfg, run_dir, args.recipe)
    resume, notes = resolve_resume(run_dir, args.resume, is_main=rank0 and not torchrun)
    init = str(checkpoint_in(args.init)) if args.init else None
    if torchrun:
        exec_torchrun(args)
    for note in notes if rank0 else ():
        print(f"visiontrain: {note}", file=sys.stderr)
    try:
        with removed_if_set_up_fails(run_dir):
            trainer = Trainer(cfg, build_task(cfg), run_dir, resume=resume, init=init, trackers=trackers,
                              launch=Launch(args.recipe, list(args.overrides), args.command_line))
        done = resume is not None and trainer.step >= trainer.clock.total_steps
        summary = _finished(trainer, resume, run_dir) if done else trainer.fit()
        del trainer
    except Preempted as err:
        err = err.with_traceback(None)  # its frames hold the trainer (and DDP): drop them before shutdown
        shutdown()  # every rank stopped at the same, agreed step
        raise err
    except BaseException as err:
        end_trackers(trackers, status_of(err))  # fit ended them already if it raised: this does nothing then
        shutdown(barrier=False)  # other ranks may be gone: leave without waiting for them
        raise
    shutdown()
    if summary:  # rank 0 of a run with a run dir
        report = (str(run_dir / "report.html") if (run_dir / "report.html").is_file() else None) if done \
            else _final_report(run_dir)
        print(dumps_json({"run_dir": str(run_dir), "report": report, **summary}))
    end_trackers(trackers, FINISHED)  # after the report: it reaches the tracker with the final status
    return 0


def _finished(trainer: Any, resume: str, run_dir: Path) -> dict[str, Any]:
    """A resumed checkpoint already at the run's last step: nothing to train, and nothing in the
    run dir is rewritten (evaluating again would append a second final row). Every rank takes this
    branch: they loaded the same step."""
    trainer.log.print(f"{resume} is at step {trainer.step}, this run's last: nothing to train (raise "
                      f"trainer.epochs or trainer.max_steps to train further)")
    trainer.log.close()
    summary = run_dir / "summary.json"
    return json.loads(summary.read_text()) if trainer.dist.is_main and summary.is_file() else {}


def _final_report(run_dir: Path) -> str | None:
    """RUN_DIR/report.html at the end of every fit. The run is done and saved by now: a report
    that cannot be written is a warning, not a failed run (``visiontrain report`` can retry)."""
    from visiontrain.report import write_report

    try:
        return str(write_report(run_dir)[0])
    except Exception as err:  # noqa: BLE001
        print(f"visiontrain: warning: no report written to {run_dir}: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def cmd_validate(args: argparse.Namespace) -> int:
    from visiontrain.engine.evaluator import evaluate_models
    from visiontrain.engine.run import build_evaluation
    from visiontrain.trained import load_trained

    trained = load_trained(args.target, args.overrides)
    ema = trained.model(ema=True) if trained.has_ema else None
    run = build_evaluation(trained.cfg, trained.task, trained.model(), ema, trained.info)
    metrics = evaluate_models(run, trained.cfg.eval.models)
    print(dumps_json({"checkpoint": trained.path, "step": trained.state["progress"]["step"], **metrics}))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from visiontrain.predict import predict_images
    from visiontrain.trained import load_trained

    trained = load_trained(args.checkpoint)
    if not hasattr(trained.task, "predict"):
        raise C.ConfigError(f"{trained.path}: task {trained.cfg.task.name!r} has no box predictions; "
                            f"predict works for detection recipes")
    written = predict_images(trained.task, trained.model(ema=args.ema), trained.info, args.images, Path(args.out),
                             score_threshold=args.threshold)
    print(json.dumps({"out": args.out, "images": len(args.images), "detections": written}))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from visiontrain.engine.task import ExportUnsupported
    from visiontrain.export import export_checkpoint

    try:
        result = export_checkpoint(args.checkpoint, args.format, args.out, use_ema=args.ema)
    except ExportUnsupported as err:
        print(f"visiontrain: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(dumps_json(result))
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from visiontrain.engine.checkpoint import CheckpointError, atomic_save, load_checkpoint

    src = Path(args.checkpoint)
    if "sharded" not in load_checkpoint(src, resolve_sharded=False, mmap=True):
        raise CheckpointError(f"{src} is already a single-file checkpoint (it names no sharded directory); "
                              f"validate, predict, export and --init read it as it is")
    state = load_checkpoint(src)  # the sharded tensors, gathered whole in this one process
    out = Path(args.out) if args.out else src.with_name(f"{src.stem}-full.pt")
    atomic_save(state, out)
    print(json.dumps({"checkpoint": str(src), "out": str(out), "tensors": len(state["model"]),
                      "bytes": out.stat().st_size}))
    return 0


def cmd_benchmark(args: argparse.Namespace) -> int:
    from visiontrain.benchmark import format_report, run_benchmark
    from visiontrain.engine.distributed import shutdown
    from visiontrain.tasks import build_task

    cfg = C.load_config(args.recipe, args.overrides)
    try:
        result = run_benchmark(cfg, build_task(cfg), steps=args.steps, warmup=args.warmup, synthetic=args.synthetic)
    finally:
        shutdown(barrier=False)
    print(format_report(args.recipe, result))
    print(dumps_json({"recipe": args.recipe, **result}))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from visiontrain.compare import compare, config_diff

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
    from visiontrain.report import write_report

    path, plots = write_report(args.run_dir, args.out)
    print(json.dumps({"run_dir": args.run_dir, "report": str(path), "plots": plots,
                      "bytes": path.stat().st_size}))
    return 0


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless it has none worth saying (None, False, [])."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, []) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

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
    val.set_defaults(fn=cmd_validate)

    pred = sub.add_parser("predict", help="draw a detection checkpoint's boxes on images, with a COCO JSON")
    pred.add_argument("checkpoint", help="a detection checkpoint, or a run dir (its best.pt, else last.pt)")
    pred.add_argument("images", nargs="+", help="image files (PNG, JPEG, ...)")
    pred.add_argument("--out", required=True, help="output directory")
    pred.add_argument("--threshold", type=float, default=None,
                      help="minimum score drawn and written (default: the task's; 0.3 for a DETR trained with a "
                           "focal or varifocal loss, 0.5 otherwise)")
    pred.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")
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

    bench = sub.add_parser("benchmark", help="time training steps of a recipe: samples/s, data wait vs "
                                             "compute, peak memory (writes nothing)")
    bench.add_argument("recipe", help="built-in recipe name or path to a YAML file")
    bench.add_argument("overrides", nargs="*", help="key=value overrides")
    bench.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    bench.add_argument("--synthetic", action="store_true", help="replay the first batch: compute only")
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

    show = sub.add_parser("show-config", help="print the resolved config")
    show.add_argument("recipe", help="built-in recipe name or path to a YAML file")
    show.add_argument("overrides", nargs="*", help="key=value overrides")
    show.add_argument("--docs", action="store_true", help="list every key with its type and meaning")
    show.set_defaults(fn=cmd_show_config)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    from visiontrain.engine.checkpoint import CheckpointError
    from visiontrain.engine.preemption import EXIT_INTERRUPTED, Preempted
    from visiontrain.engine.guards import NonFiniteLossError, OutOfMemory
    from visiontrain.models import PretrainedUnavailable
    import visiontrain.tasks  # noqa: F401  (registers every task's config section)
    from visiontrain.launch import command_line, import_user_module

    args.command_line = command_line(sys.argv[1:] if argv is None else argv)  # recorded in provenance.json
    try:
        for module in args.imports:
            import_user_module(module)
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
    except (C.ConfigError, CheckpointError, FileNotFoundError, ValueError, yaml.YAMLError,
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
