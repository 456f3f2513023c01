"""benchmarks/gpu_check.py --dry-run: the GPU check's every stage, on the CPU with tiny sizes, so the
script is known to work before a GPU machine (15 minutes of it, start-up included) ever runs it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import procs

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_the_dry_run_passes_every_stage_and_writes_its_figures(tmp_path):
    proc = procs.run([sys.executable, SCRIPT, "--dry-run", "--out", tmp_path], timeout=2400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = result["stages"]
    assert list(stages) == ["env", "tests", "fsdp", "profile", "throughput", "recipes", "input"]
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(stages, "ok")

    env, = stages["env"]["records"]
    assert env["cuda_available"] is False and env["torch"].startswith("2.") and env["pycocotools"] is True

    tests, = stages["tests"]["records"]
    # the rehearsal's one test of each outcome came back as such, and its unmarked test was deselected
    assert {k: tests[k] for k in ("tests", "passed", "failed", "skipped")} == {"tests": 3, "passed": 1, "failed": 1,
                                                                              "skipped": 1}, tests
    assert [f["test"].rsplit("::", 1)[-1] for f in tests["failures"]] == ["test_a_failure_is_reported"]

    fsdp = {r["run"]: r for r in stages["fsdp"]["records"]}
    assert set(fsdp) == {"fsdp", "unsharded"}
    # Finite or not is the finding, not a test: on this CPU bf16 convolutions of a ResNet-18 went
    # non-finite now and then, with or without FSDP (docs/distributed.md). Either way the run ends
    # cleanly: finite, or stopped by the non-finite check with its message.
    for r in fsdp.values():
        assert r["steps_logged"] == 2 and (r["finite"] or r["nonfinite_stop"]), r
        assert r["finite"] == (r["exit"] == 0), r

    profile, = stages["profile"]["records"]
    for runner in ("raw", "engine"):
        assert profile[runner]["wall_ms_per_step"] > 0 and profile[runner]["top_host_ms_per_step"], profile

    cases = {(r["model"], r["compiled"]): r for r in stages["throughput"]["records"]}
    assert set(cases) == {("resnet18", False), ("vit_tiny_patch16_224", False), ("detr_small", False),
                          ("resnet18", True)}
    for r in cases.values():
        assert r["engine_images_per_s"] > 0 and r["raw_images_per_s"] > 0 and r["gflop_per_step"] > 0, r

    recipes = {r["recipe"]: r for r in stages["recipes"]["records"]}
    assert set(recipes) == {"classify-fashion", "ssl-dino", "detect-yolov3", "detect-detr", "detect-faster-rcnn",
                            "segment-mask-rcnn", "segment-panoptic", "segment-semantic"}
    for r in recipes.values():  # each recipe's first batch through its loader as shipped, replayed
        assert r["synthetic"]["synthetic"] is True and r["synthetic"]["samples_per_s"] > 0, r
    real = recipes["classify-fashion"]  # and one recipe's real-data run, paired with its replay
    assert real["real"]["samples_per_s"] > 0 and 0 <= real["data_wait_share"] <= 1, real

    folder, *runs = stages["input"]["records"]  # the JPEG folder it made, then a record a benchmark run
    assert folder["train_images"] == 48 and folder["mean_kb"] > 0, folder
    cases = {(r["decode"], r["workers"], r["synthetic"], r.get("precision_asked")): r for r in runs}
    assert set(cases) == {("cpu", 0, True, None), ("cpu", 0, False, None), ("gpu", 0, False, None),
                          ("cpu", 0, True, "auto")}
    for r in cases.values():
        assert r["images_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1, r
    assert cases["cpu", 0, True, None]["ceiling"] is True  # the step alone at the run's fp32: each ratio's base
    assert cases["cpu", 0, False, None]["x_ceiling"] > 0 and cases["gpu", 0, False, None]["x_ceiling"] > 0
    assert cases["cpu", 0, True, "auto"]["precision"] in ("fp32", "bf16")  # what auto picks on this CPU

    summary = (tmp_path / "summary.txt").read_text()
    assert "throughput: ok" in summary and "ratio" in summary and "data wait" in summary
    assert "x ceiling" in summary and "trainer.precision=auto picked" in summary
    assert "======== recipes" in (tmp_path / "stages.log").read_text()
