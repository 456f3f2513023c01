"""visiontrain.core._tv_compat.ensure_torchvision, each check in a fresh interpreter."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

PRELUDE = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s:%(levelname)s:%(message)s")
from visiontrain.core import _tv_compat
t0 = time.perf_counter()
mode = _tv_compat.ensure_torchvision()
dt = time.perf_counter() - t0
assert _tv_compat.ensure_torchvision() == mode  # second call in-process: no-op
"""

OPS = PRELUDE + """
import torch, torchvision
from torchvision import ops, tv_tensors
from torchvision.transforms import v2

boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 10.5]])
scores = torch.tensor([0.9, 0.8, 0.7, 0.95])
keep = ops.nms(boxes, scores, 0.5).tolist()

rois = torch.tensor([[0, 0, 0, 4, 4]], dtype=torch.float)
const = ops.roi_align(torch.full((1, 1, 4, 4), 5.0), rois, output_size=2, sampling_ratio=2)
ramp = ops.roi_align(torch.arange(16.0).view(1, 1, 4, 4), rois, output_size=2, sampling_ratio=2)
pooled = ops.roi_pool(torch.arange(16.0).view(1, 1, 4, 4), rois, output_size=1)

img = tv_tensors.Image(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8))
bb = tv_tensors.BoundingBoxes([[0, 0, 16, 16]], format="XYXY", canvas_size=(32, 32))
out_img, out_bb = v2.Compose([v2.Resize((64, 64)), v2.RandomHorizontalFlip(p=1.0)])(img, bb)

jpeg = torchvision.io.encode_jpeg(torch.full((3, 8, 8), 128, dtype=torch.uint8))
decoded = torchvision.io.decode_jpeg(jpeg)

class DS(torch.utils.data.Dataset):  # ops in fork()ed DataLoader workers
    def __len__(self): return 4
    def __getitem__(self, i): return ops.nms(boxes, scores, 0.5)
ctx = "fork" if sys.platform.startswith("linux") else None
worker_keeps = [b.tolist() for b in torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=2,
                                                                   multiprocessing_context=ctx)]

import timm
model = timm.create_model("resnet18", num_classes=3, pretrained=False).eval()
with torch.no_grad():
    logits = model(torch.randn(2, 3, 64, 64))

print(json.dumps(dict(mode=mode, state=_tv_compat.state, dt=dt, keep=keep,
                      const=const.flatten().tolist(), ramp=ramp.flatten().tolist(), pooled=pooled.item(),
                      img_shape=list(out_img.shape), boxes=out_bb.tolist(),
                      is_bb=isinstance(out_bb, tv_tensors.BoundingBoxes),
                      decoded=list(decoded.shape), worker_keeps=worker_keeps, logits=list(logits.shape),
                      finite=bool(torch.isfinite(logits).all()))))
"""

AGAIN = PRELUDE + "print(json.dumps(dict(mode=mode, state=_tv_compat.state, dt=dt)))\n"


def run(code, cache, **env):
    e = dict(os.environ, VISIONTRAIN_CACHE=str(cache), **env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, e.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                       timeout=120)
    return r


def last_json(r):
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("vtcache")


@pytest.fixture(scope="module")
def first(cache):
    r = run(OPS, cache)
    return last_json(r), r.stderr


def test_native_ops_work(first):
    res, _ = first
    assert res["mode"] in ("native", "stubbed")
    assert res["keep"] == [3, 2]
    assert res["const"] == pytest.approx([5.0] * 4)
    ramp = res["ramp"]
    assert ramp[0] < ramp[1] < ramp[3] and ramp[0] < ramp[2] < ramp[3]
    assert res["pooled"] == 15.0
    assert res["img_shape"] == [3, 64, 64]
    assert res["is_bb"] and res["boxes"] == [[32.0, 0.0, 64.0, 32.0]]
    assert res["decoded"] == [3, 8, 8]
    assert res["worker_keeps"] == [[3, 2]] * 4
    assert res["logits"] == [2, 3] and res["finite"]


def test_first_call_compiles_and_logs_once(first, cache):
    res, stderr = first
    if res["mode"] == "native":
        pytest.skip("torchvision loads natively here; nothing to stub")
    assert res["state"]["compiled"] is True and res["state"]["symbols"] > 0
    assert Path(res["state"]["lib_dir"]).parent == cache / "tv_cuda_stubs"
    # said once, plainly: what a user sees after a set-up that keeps CUDA builds of torch out
    assert stderr.count("visiontrain:INFO:") == 1 and "compatibility library was built once" in stderr
    assert "stub symbols" not in stderr and "abort" not in stderr
    assert not [p for p in (cache / "tv_cuda_stubs").iterdir() if p.name.startswith(".tmp")]


def test_second_process_hits_cache(first, cache):
    res0, _ = first
    if res0["mode"] == "native":
        pytest.skip("torchvision loads natively here; nothing to stub")
    res = last_json(r := run(AGAIN, cache))
    assert res["mode"] == "stubbed"
    assert res["state"]["compiled"] is False
    assert res["state"]["lib_dir"] == res0["state"]["lib_dir"]
    assert "loaded cached" not in r.stderr and "visiontrain:INFO:" not in r.stderr  # said once per machine


def test_torchvision_imported_first_is_a_clear_error(first, cache):
    if first[0]["mode"] == "native":
        pytest.skip("torchvision loads natively here; nothing to stub")
    r = run("""
        try:
            import torchvision
        except Exception:
            pass
        from visiontrain.core._tv_compat import ensure_torchvision
        try:
            ensure_torchvision()
        except RuntimeError as e:
            print("ERR", e)
        """, cache)
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "ensure_torchvision() must run before" in r.stdout


def test_missing_compiler_is_a_clear_error(first, tmp_path):
    if first[0]["mode"] == "native":
        pytest.skip("torchvision loads natively here; nothing to stub")
    r = run("""
        from visiontrain.core._tv_compat import ensure_torchvision
        try:
            ensure_torchvision()
        except RuntimeError as e:
            print("ERR", e)
        """, tmp_path / "empty-cache", CC="/nonexistent/cc")
    assert r.returncode == 0, r.stderr
    assert "no C compiler" in r.stdout and "install gcc" in r.stdout and "CPU build of torchvision" in r.stdout
