"""`visiontrain tune` through the CLI on scikit-learn's digits: the space's checks, pruning, the study's
files, best.yaml, a SIGKILLed tuner continued by the same command, two tuners sharing one study,
MLflow. Every trial is a real `visiontrain fit` of classify-fashion."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import postgres_server
from mlflow_histories import histories
from procs import alive, descendants, finish, kill_everything, popen, run_cli, wait_for
from visiontrain.app import cli
from visiontrain.core.cores import affinity, shares
from visiontrain.engine.records.provenance import read_provenance

# digits: the offline dataset on which a trial takes seconds. Batches of 16 make a trial long enough
# (about 180 steps) for a tuner to stop it part-way (the pruning and kill tests need that).
# trainer.plots=false: a trial's own figures cost about 2 s of CPU and are not tested here (the study's are).
TRIAL = ["data.name=digits", "data.batch_size=16", "trainer.epochs=2", "trainer.plots=false"]
LR_SPACE = "optim.lr: {categorical: [0.003, 1.0e-06]}\n"
# CI installs the extra (VISIONTRAIN_REQUIRE_MLFLOW=1): there a missing one fails the study's fixture
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None or os.environ.get("VISIONTRAIN_REQUIRE_MLFLOW") == "1"
SPACE = "optim.lr: {log: [1.0e-3, 1.0e-2]}\ntask.drop_rate: {float: [0.0, 0.3]}\n"
STORAGE_SECRETS = ("pw-5f3a9c", "tok-8e1d27")


def tune_args(study: Path, space: Path, trials: int, *extra: str) -> list[str]:
    return ["tune", "classify-fashion", "--space", str(space), "--trials", str(trials), "--study-dir", str(study),
            *TRIAL, *extra]


def space_file(tmp_path: Path, text: str, name: str = "space.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def start_tuner(args: list[str]) -> subprocess.Popen:
    return popen([sys.executable, "-m", "visiontrain", *args])


def study_json(study: Path) -> dict:
    return json.loads((study / "study.json").read_text())


def eval_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r["step"] for r in rows if r.get("kind") == "eval"]


@pytest.mark.parametrize("text, extra, message", [
    ("optim.lrr: {log: [1.0e-3, 1.0e-2]}\n", [], "unknown config key 'optim.lrr'; did you mean optim.lr"),
    ("optim.lr: {uniform: [0.1, 0.2]}\n", [], "optim.lr: expected a mapping with one of float, log, int, categorical"),
    ("optim.lr: {float: [0.2, 0.1]}\n", [], "optim.lr: expected low < high, got [0.2, 0.1]"),
    ("optim.lr: {log: [0.0, 0.1]}\n", [], "a log-uniform range must be above 0"),
    ("optim.lr: {float: [0.1, 0.2], steps: 3}\n", [], "unknown option steps"),
    ("data.eval_batch_size: {float: [8.5, 16.5]}\n", [], "data.eval_batch_size: expected int"),
    ("task.drop_rate: {categorical: []}\n", [], "categorical expects a non-empty list"),
    # Optuna would print its own UserWarning about it at every trial, and search [2, 6]
    ("trainer.epochs: {int: [2, 7], step: 2}\n", [], "trainer.epochs: [2, 7] is not a whole number of steps of 2 "
                                                     "(the values drawn would stop at 6): write [2, 6] or [2, 8]"),
    ("task.drop_rate: {float: [0.0, 0.5], step: 0.2}\n", [], "[0.0, 0.5] is not a whole number of steps of 0.2"),
    (SPACE, ["optim.lr=0.01"], "optim.lr is searched here and set on the command line"),
])
def test_a_bad_space_is_one_line_before_any_trial(tmp_path, capsys, text, extra, message):
    space = space_file(tmp_path, text)
    study = tmp_path / "study"
    code = cli.main(tune_args(study, space, 2, *extra))
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err and str(space) in err, err
    assert not study.exists()  # nothing ran, nothing was made


def test_a_study_continues_only_its_own_search(tmp_path, capsys):
    from visiontrain.tune.study import TuneSettings, prepare

    study = tmp_path / "study"
    first = space_file(tmp_path, SPACE)
    prepare(TuneSettings("classify-fashion", str(first), 2, study, list(TRIAL)))
    other = space_file(tmp_path, "optim.lr: {log: [1.0e-4, 1.0e-2]}\n", "other.yaml")
    code = cli.main(tune_args(study, other, 2))
    err = capsys.readouterr().err
    assert code == 2 and "was started with another space" in err and "another --study-dir" in err, err


@pytest.fixture(scope="module")
def pruned_study(tmp_path_factory) -> Path:
    """Three trials, the third with an lr of 1e-6 (the sampler's seed 6 draws good, good, bad): the
    median pruner stops it at its first evaluation. MLflow records each trial."""
    root = tmp_path_factory.mktemp("tune")
    space = space_file(root, LR_SPACE)
    tracking = ["logging.mlflow=true"] if HAS_MLFLOW else []
    # The study's database, named with secrets in its URL (SQLite ignores them, with a warning):
    # no file of the study and no line of the tuner may hold them.
    storage = f"sqlite:///{root / 'db.sqlite'}?password={STORAGE_SECRETS[0]}&token={STORAGE_SECRETS[1]}"
    # 4 epochs: the pruned trial is stopped after its first, well before its end
    proc = run_cli(*tune_args(root / "study", space, 3, "--seed", "6", "trainer.epochs=4", "--storage", storage,
                              *tracking), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (root / "tuner-output.txt").write_text(proc.stdout + proc.stderr)
    return root / "study"


def test_no_file_of_the_study_and_no_line_of_the_tuner_holds_the_storage_secrets(pruned_study):
    written = [p for p in pruned_study.rglob("*") if p.is_file()] + [pruned_study.parent / "tuner-output.txt"]
    assert len(written) > 20 and (pruned_study / "study.json").is_file()
    holding = [str(p) for p in written for secret in STORAGE_SECRETS if secret.encode() in p.read_bytes()]
    assert not holding, holding
    assert study_json(pruned_study)["storage"].endswith("db.sqlite?password=***&token=***")


def test_the_worst_trial_is_pruned_with_its_checkpoint_written(pruned_study):
    summary = study_json(pruned_study)
    assert summary["counts"] == {"complete": 2, "pruned": 1}
    states = {r["number"]: (r["state"], r["params"]["optim.lr"]) for r in summary["trials"]}
    assert states == {0: ("complete", 0.003), 1: ("complete", 0.003), 2: ("pruned", 1e-06)}
    run = pruned_study / "trials" / "trial-0002"
    record = json.loads((run / "trial.json").read_text())
    first_eval = [s for s in eval_steps(run) if s > 0][0]
    assert record["state"] == "pruned" and record["pruned_at_step"] == first_eval
    assert (run / "checkpoints" / "last.pt").is_file() and record["exit_code"] in (0, 4)
    # Whether the SIGTERM lands before the trial's end depends on the machine's load (a digits epoch
    # takes about a second); the SIGKILL test shows a signalled fit stopping part-way with its last.pt.


def test_the_study_files_and_best_yaml_train_to_the_best_trial(pruned_study, tmp_path):
    summary = study_json(pruned_study)
    best = summary["best"]
    assert best["number"] in (0, 1) and best["value"] == max(r["value"] for r in summary["trials"][:2])
    rows = (pruned_study / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("trial,state,top1,optim.lr") and len(rows) == 4
    for name in ("history", "parallel_coordinates"):
        assert (pruned_study / "plots" / f"{name}.png").stat().st_size > 10_000
    page = (pruned_study / "report.html").read_text()
    assert "trials/trial-0002/report.html" in page and "importances" in page  # drawn, or why not
    proc = run_cli("fit", str(pruned_study / "best.yaml"), "--run-dir", str(tmp_path / "best"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained = json.loads((tmp_path / "best" / "summary.json").read_text())
    evals = [json.loads(line) for line in (tmp_path / "best" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["top1"] for r in evals if r["kind"] == "eval") == best["value"]
    assert trained["final"]["top1"] > 50


@pytest.mark.skipif(not HAS_MLFLOW, reason="needs the MLflow extra: pip install 'visiontrain[mlflow]'")
def test_each_trial_is_a_run_of_the_study_in_mlflow(pruned_study):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{pruned_study / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("study")
    runs = client.search_runs([experiment.experiment_id])
    tags = sorted((r.info.run_name, r.data.tags["visiontrain.tune.state"]) for r in runs)
    assert tags == [("trial-0000", "complete"), ("trial-0001", "complete"), ("trial-0002", "pruned")]


@pytest.mark.skipif(not HAS_MLFLOW, reason="needs the MLflow extra: pip install 'visiontrain[mlflow]'")
def test_four_trials_at_once_lose_nothing_in_the_study_mlflow_store(tmp_path):
    """``--jobs 4``: four fits create and write the study's one SQLite store at once. Every trial is a
    finished run holding every number of every row of its metrics.jsonl, at its step. (Before the
    store was opened under a lock, three of four fits lost their run to each other's migrations.)"""
    from mlflow import MlflowClient

    study = tmp_path / "study"
    # batches of 64, one epoch: no trial here needs stopping part-way
    proc = run_cli(*tune_args(study, space_file(tmp_path, SPACE), 4, "--jobs", "4", "--pruner", "none",
                              "data.batch_size=64", "trainer.epochs=1", "logging.mlflow=true"), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{study / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("study").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"trial-{n:04d}" for n in range(4)]
    # each job's trial ran on its share of the tuner's cores (its affinity), not on all of them
    usable = sorted(read_provenance(study / "trials" / r.info.run_name)["launches"][-1]["usable_cores"] for r in runs)
    assert usable == sorted(len(s) for s in shares(affinity(), 4))
    for run in runs:
        run_dir = study / "trials" / run.info.run_name
        assert "MLflow" not in (run_dir / "fit.log").read_text()  # no warning: the tracker never gave up
        assert run.info.status == "FINISHED" and run.data.tags["visiontrain.tune.state"] == "complete"
        expected = histories(run_dir)
        assert "eval/top1" in expected and set(run.data.metrics) == set(expected)
        for key, points in expected.items():
            logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            assert logged == points, (run.info.run_name, key)


def test_a_sigkilled_tuner_is_continued_by_the_same_command(tmp_path):
    space = space_file(tmp_path, SPACE)
    study = tmp_path / "study"
    # every trial runs to its end; 6 epochs, not 2: the tuner is killed after trial 1's first evaluation,
    # and on a fast machine the 89 steps of a second epoch took less than that kill (the trial had ended)
    args = tune_args(study, space, 3, "--seed", "0", "--pruner", "none", "trainer.epochs=6")
    tuner = start_tuner(args)
    second = study / "trials" / "trial-0001"
    wait_for(lambda: any(s > 0 for s in eval_steps(second)), "trial 1's first evaluation", tuner)
    trial_procs = descendants(tuner.pid)
    os.kill(tuner.pid, signal.SIGKILL)
    finish(tuner, 30)
    end = time.monotonic() + 60
    while alive(trial_procs) and time.monotonic() < end:  # each trial writes its last.pt and ends
        time.sleep(0.2)
    assert not alive(trial_procs)
    assert (second / "checkpoints" / "last.pt").is_file()
    cut = max(eval_steps(second))

    proc = run_cli(*args, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trial 1: its tuner (pid" in proc.stderr and f"trial 1 resumed in {second}" in proc.stderr
    summary = study_json(study)
    assert summary["counts"] == {"complete": 3}
    # Optuna's attempt 1 failed and was continued as attempt 2 (never counted), the next new trial is 3;
    # the trial keeps the number of its run dir through both attempts
    rows = {r["number"]: r for r in summary["trials"]}
    assert sorted(rows) == [0, 1, 3] and rows[1]["resumed"] and rows[1]["optuna_trial"] == 2
    assert all(r["run_dir"] == f"trials/trial-{n:04d}" for n, r in rows.items())
    assert json.loads((second / "trial.json").read_text())["trial"] == 1
    launches = json.loads((second / "provenance.json").read_text())["launches"]
    assert len(launches) == 2 and launches[1]["step"] > 0 and launches[1]["resumed_from"].endswith("last.pt")
    assert eval_steps(second) == sorted(set(eval_steps(second))) and max(eval_steps(second)) > cut


def test_two_tuners_share_one_study(tmp_path):
    """As on two machines: each tuner its own study dir, one --storage, started at the same moment."""
    import optuna

    space = space_file(tmp_path, SPACE)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    # every trial runs to its end; batches of 64: no trial here needs stopping part-way
    shared = ["--storage", storage, "--study-name", "shared", "--pruner", "none", "data.batch_size=64"]
    tuners = [start_tuner([*tune_args(tmp_path / "a", space, 4, *shared), "--jobs", "2"]),
              start_tuner(tune_args(tmp_path / "b", space, 4, *shared))]
    outs = [finish(t, 400) for t in tuners]
    assert [t.returncode for t in tuners] == [0, 0], [o[1][-2000:] for o in outs]
    loaded = optuna.load_study(study_name="shared", storage=storage)
    done = [t for t in loaded.trials if t.state.name == "COMPLETE"]
    assert len(done) == 4 and {t.user_attrs["tuner"]["pid"] for t in done} == {t.pid for t in tuners}
    counts = [study_json(tmp_path / name)["counts"] for name in ("a", "b")]  # each shows the whole study,
    assert {"complete": 4} in counts and all(sum(c.values()) == 4 for c in counts)  # as it was when it ended
    assert study_json(tmp_path / "a")["storage"] == storage
    runs = {t.number: t.user_attrs["run_dir"] for t in done}
    assert sum((tmp_path / d / r / "trial.json").is_file() for d in "ab" for r in runs.values()) == 4


@pytest.fixture
def postgres_url() -> str:
    """A new database on a PostgreSQL server of the test's own (tests/support/postgres_server.py),
    stopped and removed after it. Without PostgreSQL or its driver the test is skipped, unless
    VISIONTRAIN_REQUIRE_POSTGRES=1 (CI, where scripts/setup.sh installs both) makes that a failure."""
    why = postgres_server.missing()
    if why is None and importlib.util.find_spec("psycopg") is None:  # SQLAlchemy 2.1's for postgresql://
        why = "PostgreSQL's driver is not installed (pip install 'psycopg[binary]', in the test extra)"
    if why is not None:
        if os.environ.get("VISIONTRAIN_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"VISIONTRAIN_REQUIRE_POSTGRES=1 but {why}")
        pytest.skip(why)
    with postgres_server.postgres_server() as url:
        yield url


def test_two_tuners_on_postgresql_one_sigkilled_mid_trial(tmp_path, postgres_url):
    """Two tuners as on two machines (each its own study dir) share one study on a real PostgreSQL
    server; one is SIGKILLed in the middle of a trial. The other finds that trial's tuner gone, marks
    the attempt failed and runs the trial again under its number: the study ends with its trials,
    none lost or counted twice."""
    import optuna

    space = space_file(tmp_path, SPACE)
    shared = ["--storage", postgres_url, "--study-name", "shared", "--pruner", "none"]
    a_args, b_args = (tune_args(tmp_path / d, space, 3, *shared) for d in "ab")
    tuners = [start_tuner(a_args), start_tuner(b_args)]
    try:
        killed = tuners[1]

        def b_trial_evaluated() -> bool:
            return any(s > 0 for run in (tmp_path / "b" / "trials").glob("trial-*") for s in eval_steps(run))

        wait_for(b_trial_evaluated, "the first evaluation of tuner b's trial", killed)
        trial_procs = descendants(killed.pid)
        os.kill(killed.pid, signal.SIGKILL)
        finish(killed, 30)
        out, err = finish(tuners[0], 400)
        assert tuners[0].returncode == 0, err[-3000:]
        end = time.monotonic() + 60
        while alive(trial_procs) and time.monotonic() < end:  # b's trial gets SIGTERM as its tuner dies
            time.sleep(0.2)
        assert not alive(trial_procs)
    finally:
        for tuner in tuners:
            if tuner.poll() is None:
                kill_everything(tuner)
    trials = optuna.load_study(study_name="shared", storage=postgres_url).trials
    failed = [t for t in trials if t.state.name == "FAIL"]
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(failed) == 1 and len(done) == 3 and len(trials) == 4, [(t.number, t.state.name) for t in trials]
    lost, again = failed[0], next(t for t in done if t.user_attrs.get("resumes") == failed[0].number)
    assert lost.user_attrs["tuner"]["pid"] == killed.pid and again.user_attrs["tuner"]["pid"] == tuners[0].pid
    assert again.params == lost.params and again.user_attrs["trial"] == lost.user_attrs["trial"]
    # each trial once, under its own number; the one run again under the number of its lost attempt
    n = lost.user_attrs["trial"]
    assert sorted(t.user_attrs["trial"] for t in done) == sorted({t.number for t in done if t is not again} | {n})
    assert f"trial {n}: its tuner (pid {killed.pid}) is gone" in err, err[-3000:]
    assert f"trial {n} resumed in {tmp_path / 'a' / 'trials' / f'trial-{n:04d}'}" in err, err[-3000:]
    assert (tmp_path / "b" / "trials" / f"trial-{n:04d}" / "checkpoints" / "last.pt").is_file()
    assert study_json(tmp_path / "a")["counts"] == {"complete": 3}
    assert study_json(tmp_path / "a")["storage"] == postgres_url


def test_a_trial_whose_heartbeat_stopped_on_another_machine_is_taken_once(tmp_path, postgres_url, monkeypatch):
    """The other way a dead tuner is found, the only one across machines: its trial's heartbeat in the
    PostgreSQL study stops. Two tuners (two study dirs) look at once; the trial is failed and enqueued
    once, with its parameters, number and run dir, and the next trial asked for is its resume."""
    from optuna.trial import TrialState

    from visiontrain.tune import study as tune_study

    monkeypatch.setattr(tune_study, "GRACE_S", 1)  # the storage's grace period: stale after 1 s, not 2 min
    space = space_file(tmp_path, SPACE)
    searches = [tune_study.prepare(tune_study.TuneSettings("classify-fashion", str(space), 2, tmp_path / d, list(TRIAL),
                                                           storage=postgres_url, study_name="shared")) for d in "ab"]
    orphan = tune_study.next_trial(searches[0])
    params = {p.key: p.suggest(orphan) for p in searches[0].space}
    orphan.set_user_attr("run_dir", "trials/trial-0000")
    orphan.set_user_attr("tuner", {"host": "another-machine", "pid": 1, "started": None})
    time.sleep(2.5)  # no heartbeat since the trial was asked for
    lookers = [threading.Thread(target=tune_study.claim_orphans, args=(s,)) for s in searches]
    for t in lookers:
        t.start()
    for t in lookers:
        t.join(60)
    trials = searches[1].study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    resume = tune_study.next_trial(searches[1])
    assert resume.number == 1 and resume.user_attrs["resumes"] == 0 and resume.user_attrs["trial"] == 0
    assert resume.user_attrs["run_dir"] == "trials/trial-0000"
    assert {p.key: p.suggest(resume) for p in searches[1].space} == params


@pytest.mark.parametrize("url, shown", [
    ("postgresql://me:secret@127.0.0.1:1/none", "postgresql://me:***@127.0.0.1:1/none"),
    ("postgresql://me:se@cret@127.0.0.1:1/none", "postgresql://me:***@127.0.0.1:1/none"),  # an @ as typed
    ("postgresql://me@127.0.0.1:1/none?password=secret&sslmode=off",
     "postgresql://me@127.0.0.1:1/none?password=***&sslmode=off"),
])
def test_a_storage_that_cannot_be_opened_is_one_line_without_its_password(tmp_path, capsys, monkeypatch, url, shown):
    from visiontrain.tune import study as tune_study

    # with PostgreSQL's driver installed the refused connection is tried again, 6 s in all: once says the same
    monkeypatch.setattr(tune_study, "CONNECT_TRIES", 1)
    space = space_file(tmp_path, SPACE)
    code = cli.main(tune_args(tmp_path / "s", space, 2, "--storage", url))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--storage {shown}: cannot open" in err and "secret" not in err and "cret" not in err, err


def test_a_missing_postgresql_driver_is_one_line_naming_its_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as on a machine without the driver
    url = "postgresql://me@127.0.0.1:1/none"
    code = cli.main(tune_args(tmp_path / "s", space_file(tmp_path, SPACE), 2, "--storage", url))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--storage {url}: cannot open" in err and "pip install 'psycopg[binary]'" in err, err


def test_evaluations_are_reported_by_their_number_not_their_step(tmp_path):
    """Trials of different batch sizes evaluate at different steps after the same epochs: the pruner
    compares them at the evaluation's number. The one at step 0 (the initialisation) is not reported."""
    from visiontrain.tune.trial import Objective, Watch

    class Trial:
        def __init__(self):
            self.reports = []

        def report(self, value, step):
            self.reports.append((value, step))

        def should_prune(self):
            return False

    rows = [{"kind": "eval", "step": s, "epoch": 0, "time": 0.0, "top1": v, "ema/top1": v - 1}
            for s, v in ((0, 10.0), (117, 80.0), (234, 85.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "ev')
    trial = Trial()
    watch = Watch(trial, tmp_path, Objective("top1", "max"), lambda step, value: None)
    assert watch.read() is False and watch.read() is False  # a second read reports nothing again
    assert trial.reports == [(80.0, 1), (85.0, 2)] and watch.value == 85.0
    assert Objective("top1", "min").of_row(rows[1]) == 79.0  # the better of the model's and the EMA's
