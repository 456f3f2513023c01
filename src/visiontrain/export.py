"""`visiontrain export`: a training checkpoint's network as ONNX, a torch.export program or
TorchScript, re-run against PyTorch on the same input.

Generic on purpose: a task says what to trace through ``Task.export_spec`` (a tensors-in,
tensors-out module and an example input); this file knows no model family.

ONNX goes through torch's TorchScript-based exporter (``dynamo=False``, opset 17): it carries
torchvision's ONNX rules for NMS and RoIAlign, so detectors export with their post-processing,
where the torch.export-based exporter stops at the data-dependent shapes of NMS (and would also
need onnxscript). The file is then checked with ``onnx.checker`` and run in onnxruntime.
"""
from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from visiontrain.engine.task import ExportSpec, ExportUnsupported, Task

FORMATS: dict[str, str] = {"onnx": ".onnx", "exported-program": ".pt2", "torchscript": ".torchscript.pt"}
ONNX_OPSET = 17


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _write(spec: ExportSpec, fmt: str, path: Path) -> None:
    """Trace ``spec.module`` into ``path``; any failure becomes ExportUnsupported naming the format."""
    inputs = spec.example_inputs
    try:
        # Tracer warnings, deprecation notes and the graph dumps torch.export prints to stderr on a
        # failure are noise to a user: a failure still raises, and becomes one line below.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")
            if fmt == "onnx":
                axes = {n: {0: "batch"} for n in [*spec.input_names, *spec.output_names]} \
                    if spec.dynamic_batch else None
                torch.onnx.export(spec.module, inputs, str(path), input_names=spec.input_names,
                                  output_names=spec.output_names, opset_version=ONNX_OPSET, dynamic_axes=axes,
                                  dynamo=False)
            elif fmt == "exported-program":
                shapes = tuple({0: torch.export.Dim.AUTO} if spec.dynamic_batch else None for _ in inputs)
                torch.export.save(torch.export.export(spec.module, inputs, dynamic_shapes=shapes), str(path))
            else:
                torch.jit.save(torch.jit.trace(spec.module, inputs, check_trace=False), str(path))
    except Exception as err:  # the exporters raise many types; the user needs one clear line
        hint = {"exported-program": "torch.export cannot capture it (e.g. data-dependent shapes in NMS); "
                                    "try --format onnx or torchscript"}.get(fmt, "see the message")
        raise ExportUnsupported(f"cannot export to {fmt}: {hint}: {type(err).__name__}: {_first_line(err)}") from err


def _run(fmt: str, path: Path, spec: ExportSpec) -> tuple[torch.Tensor, ...]:
    """Outputs of the written file on the example input, read back the way a user would load it."""
    inputs = spec.example_inputs
    if fmt == "onnx":
        try:
            import onnx
            import onnxruntime as ort
        except ImportError as err:
            raise ExportUnsupported(f"checking an ONNX export needs onnx and onnxruntime ({err}); "
                                    f"pip install onnx onnxruntime") from err
        onnx.checker.check_model(str(path))
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        feeds = {n: x.numpy() for n, x in zip(spec.input_names, inputs) if n in names}  # host sync (export check)
        return tuple(torch.from_numpy(o) for o in session.run(spec.output_names, feeds))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load: still the TorchScript loader
        if fmt == "exported-program":
            return _as_tuple(torch.export.load(str(path)).module()(*inputs))
        return _as_tuple(torch.jit.load(str(path))(*inputs))


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
    with torch.no_grad():
        expected = _as_tuple(spec.module(*spec.example_inputs))
    if len(expected) != len(spec.output_names):
        raise ExportUnsupported(f"task {task.name!r}: export_spec names {len(spec.output_names)} outputs but the "
                                f"module returns {len(expected)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    _write(spec, fmt, out)
    diff = max_abs_diff(expected, _run(fmt, out, spec), spec.output_names)
    return {"path": str(out), "format": fmt, "max_abs_diff": diff,
            "inputs": {n: list(x.shape) for n, x in zip(spec.input_names, spec.example_inputs)},
            "outputs": list(spec.output_names)}


def export_checkpoint(checkpoint: str | Path, fmt: str, out: str | Path | None = None, *,
                      use_ema: bool = False) -> dict[str, Any]:
    """Rebuild a training checkpoint's task and model (config + data_info + weights) and export it;
    ``checkpoint`` may be a run dir; ``out`` defaults to the checkpoint's path with the format's suffix.
    The result names the checkpoint file it read."""
    from visiontrain.trained import load_trained

    if fmt not in FORMATS:
        raise ExportUnsupported(f"--format: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    trained = load_trained(checkpoint)
    path = Path(out) if out else Path(trained.path).with_suffix(FORMATS[fmt])
    return {"checkpoint": trained.path,
            **export_model(trained.task, trained.model(ema=use_ema), trained.info, fmt, path)}
