"""`visiontrain export`: a training checkpoint's network as ONNX, a torch.export program or
TorchScript, re-run against PyTorch on the same input.

Generic on purpose: a task says what to trace through ``Task.export_spec`` (a tensors-in,
tensors-out module and an example input); this file knows no model family.

ONNX goes through torch's TorchScript-based exporter (``dynamo=False``, opset 17): it carries
torchvision's ONNX rules for NMS and RoIAlign, so detectors export with their post-processing,
where the torch.export-based exporter stops at the data-dependent shapes of NMS (and would also
need onnxscript). The file is then checked with ``onnx.checker`` and run in onnxruntime, on the
example input and on each of the spec's ``check_inputs`` (a detector's second aspect ratio, which
proves its height and width are free), and it carries the task's ``metadata`` (class names, input
size and normalisation, box format...) in its ``metadata_props``, so that it runs without visiontrain.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from visiontrain import __version__
from visiontrain.engine.protocols.task import ExportSpec, ExportUnsupported, Task
from visiontrain.rundir.write_failure import WriteError, os_error_in, why_not_written
from visiontrain.use.trained import load_trained

FORMATS: dict[str, str] = {"onnx": ".onnx", "exported-program": ".pt2", "torchscript": ".torchscript.pt"}
ONNX_OPSET = 17


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def dynamic_axes(spec: ExportSpec, fmt: str) -> dict[str, dict[int, str]] | None:
    """The axes left free in ``fmt``, by input/output name: ONNX takes the batch and the spec's own
    (a detector's height and width), torch.export the batch of each input; a TorchScript trace
    declares none (None)."""
    if fmt == "torchscript":
        return None
    names = [*spec.input_names, *spec.output_names] if fmt == "onnx" else list(spec.input_names)
    axes: dict[str, dict[int, str]] = {n: {0: "batch"} for n in names} if spec.dynamic_batch else {}
    for name, extra in (spec.dynamic_axes.items() if fmt == "onnx" else ()):
        axes[name] = {**axes.get(name, {}), **extra}
    return {n: dict(sorted(a.items())) for n, a in axes.items()}


def write_metadata(path: Path, metadata: dict[str, Any]) -> None:
    """``metadata`` into the ONNX file's ``metadata_props``: strings as they are, anything else as
    JSON (onnxruntime gives them back through ``get_modelmeta().custom_metadata_map``)."""
    onnx, _ = _onnx()
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
    model.doc_string = f"visiontrain {metadata.get('task', '')} model; metadata_props describe its input and outputs"
    onnx.save(model, str(path))


#: What failed, in plain words, when an exporter raises for a reason other than the file.
EXPORTER_FAILED = {
    "onnx": "torch's ONNX exporter could not convert this model",
    "exported-program": "torch.export cannot capture it (e.g. data-dependent shapes in NMS); try --format onnx "
                        "or torchscript",
    "torchscript": "torch.jit.trace could not trace this model",
}


def _exported(spec: ExportSpec, fmt: str) -> bytes:
    """``spec.module`` traced into ``fmt``, as the bytes of its file; an exporter's failure becomes
    ExportUnsupported naming the format. In memory first: the file is then written by plain Python,
    whose failures (a full disk) say why, where torch's zip writer would abort the process."""
    inputs, f = spec.example_inputs, io.BytesIO()
    try:
        # Tracer warnings, deprecation notes and the graph dumps torch.export prints to stderr on a
        # failure are noise to a user: a failure still raises, and becomes one line below.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            if fmt == "onnx":
                torch.onnx.export(spec.module, inputs, f, input_names=spec.input_names,
                                  output_names=spec.output_names, opset_version=ONNX_OPSET,
                                  dynamic_axes=dynamic_axes(spec, fmt) or None, dynamo=False)
            elif fmt == "exported-program":
                shapes = tuple({0: torch.export.Dim.AUTO} if spec.dynamic_batch else None for _ in inputs)
                torch.export.save(torch.export.export(spec.module, inputs, dynamic_shapes=shapes), f)
            else:
                torch.jit.save(torch.jit.trace(spec.module, inputs, check_trace=False), f)
    except Exception as err:  # the exporters raise many types; the user needs one clear line
        raise ExportUnsupported(f"cannot export to {fmt}: {EXPORTER_FAILED[fmt]}: {type(err).__name__}: "
                                f"{_first_line(err)}") from err
    return f.getvalue()


def _write_file(spec: ExportSpec, fmt: str, out: Path, metadata: dict[str, Any]) -> None:
    """``out`` written whole or not at all: the export goes to a temporary file beside it, renamed
    over ``out`` once complete. A file that cannot be written (a read-only directory, a full disk)
    is a WriteError that says why in plain words."""
    data = _exported(spec, fmt)
    tmp = out.with_name(f".tmp-{out.name}")  # the suffix kept: onnx goes by it
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        if fmt == "onnx":
            write_metadata(tmp, metadata)
        os.replace(tmp, out)
    except Exception as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        cause = os_error_in(err)
        if cause is None:
            raise
        kept = f"{out} is as it was" if out.exists() else "nothing was written"
        raise WriteError(f"could not write the {fmt} file {out}: {why_not_written(cause, out.parent)}; {kept} "
                         f"(choose another --out)") from None


def _onnx() -> tuple[Any, Any]:
    """(onnx, onnxruntime), or ExportUnsupported saying what to install."""
    try:
        import onnx
        import onnxruntime
    except ImportError as err:
        raise ExportUnsupported(f"checking an ONNX export needs onnx and onnxruntime ({err}); "
                                f"pip install onnx onnxruntime") from err
    return onnx, onnxruntime


def _run(fmt: str, path: Path, spec: ExportSpec, checked: list[tuple[torch.Tensor, ...]]
         ) -> list[tuple[torch.Tensor, ...]]:
    """Outputs of the written file on each input tuple, read back the way a user would load it."""
    if fmt == "onnx":
        onnx, ort = _onnx()
        onnx.checker.check_model(str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        feeds = [{n: x.numpy() for n, x in zip(spec.input_names, inputs) if n in names}  # host sync (export check)
                 for inputs in checked]
        return [tuple(torch.from_numpy(o) for o in session.run(spec.output_names, f)) for f in feeds]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load: still the TorchScript loader
        module = torch.export.load(str(path)).module() if fmt == "exported-program" else torch.jit.load(str(path))
        return [_as_tuple(module(*inputs)) for inputs in checked]


def max_abs_diff(expected: Sequence[torch.Tensor], got: Sequence[torch.Tensor], names: Sequence[str]) -> float:
    """Largest |PyTorch - exported| over every output; a missing output or another shape is an error."""
    if len(got) != len(expected):
        raise ExportUnsupported(f"the exported model gives {len(got)} outputs, PyTorch {len(expected)} ({names})")
    worst = 0.0
    for name, e, g in zip(names, expected, got):
        if tuple(g.shape) != tuple(e.shape):
            raise ExportUnsupported(f"output {name!r}: exported shape {tuple(g.shape)} != PyTorch {tuple(e.shape)}")
        if e.numel():
            diff = (e.double() - g.to(e.device).double()).abs().max()
            worst = max(worst, float(diff))  # host sync (export check)
    return worst


def export_model(task: Task, model: nn.Module, info: dict[str, Any], fmt: str, out: Path) -> dict[str, Any]:
    """Write ``model`` in ``fmt`` to ``out`` and compare it with PyTorch on the spec's example input."""
    if fmt not in FORMATS:
        raise ExportUnsupported(f"--format: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    model.eval()
    spec = task.export_spec(model, info)
    spec.module.eval()
    checked = [spec.example_inputs, *(spec.check_inputs if fmt == "onnx" else ())]
    with torch.no_grad():
        expected = [_as_tuple(spec.module(*inputs)) for inputs in checked]
    if len(expected[0]) != len(spec.output_names):
        raise ExportUnsupported(f"task {task.name!r}: export_spec names {len(spec.output_names)} outputs but the "
                                f"module returns {len(expected[0])}")
    axes = dynamic_axes(spec, fmt)
    shapes = {n: list(x.shape) for n, x in zip(spec.input_names, spec.example_inputs)}
    _write_file(spec, fmt, out, {"task": task.name, "visiontrain_version": _version(), **spec.metadata,
                                 "inputs": shapes, "outputs": list(spec.output_names), "dynamic_axes": axes})
    diff = max(max_abs_diff(want, got, spec.output_names) for want, got in zip(expected, _run(fmt, out, spec, checked)))
    return {"path": str(out), "format": fmt, "max_abs_diff": diff,
            "inputs": {n: list(x.shape) for n, x in zip(spec.input_names, spec.example_inputs)},
            "outputs": list(spec.output_names), "dynamic_axes": axes,
            "checked_inputs": [{n: list(x.shape) for n, x in zip(spec.input_names, inputs)} for inputs in checked],
            "metadata": sorted(spec.metadata) if fmt == "onnx" else []}


def _version() -> str:
    return __version__


def export_checkpoint(checkpoint: str | Path, fmt: str, out: str | Path | None = None, *,
                      use_ema: bool = False) -> dict[str, Any]:
    """Rebuild a training checkpoint's task and model (config + data_info + weights) and export it;
    ``checkpoint`` may be a run dir; ``out`` defaults to the checkpoint's path with the format's suffix.
    The result names the checkpoint file it read."""
    if fmt not in FORMATS:
        raise ExportUnsupported(f"--format: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    trained = load_trained(checkpoint)
    path = Path(out) if out else Path(trained.path).with_suffix(FORMATS[fmt])
    return {"checkpoint": trained.path,
            **export_model(trained.task, trained.model(ema=use_ema), trained.info, fmt, path)}
