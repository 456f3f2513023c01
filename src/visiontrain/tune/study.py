"""``visiontrain tune``: a hyper-parameter search on Optuna whose trials are normal runs, and whose
study survives the tuner.

The study lives in an RDB storage (SQLite in the study dir unless ``--storage`` names another), so
nothing a tuner learnt dies with it. Each trial is a ``visiontrain fit`` (``tuning_trial``) in
``STUDY_DIR/trials/trial-NNNN``. A trial whose tuner died is found by the next tuner to look: on this
machine at once (its tuner's process is gone), from another machine when its heartbeat is older than
``GRACE_S``. It is then marked failed and enqueued again with the same parameters and run dir, so the
next trial started continues it from its ``last.pt`` (exactly, as any resumed run). A failed trial
that was resumed is not counted: ``--trials N`` is the study's number of trials, however many
tuners, on however many machines, made them.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from visiontrain.core import config as C
from visiontrain.core.cores import affinity, shares
from visiontrain.core.redact import redact_url, scrub
from visiontrain.core.stop_signals import STOP_SIGNALS, Preempted
from visiontrain.engine.protocols.task import registered_task
from visiontrain.rundir.run_files import MLFLOW_DB_FILE
from visiontrain.rundir.run_lock import RunDirBusy, check_free
from visiontrain.tune.space import Param, check_against, override, read_space
from visiontrain.tune.trial import (COMPLETE, INTERRUPTED, PRUNED, USAGE, Objective, Outcome, TrialProcess, Watch,
                                    fit_command, run_trial, trial_env)

log = logging.getLogger("visiontrain")

STUDY_DB, TRIALS_DIR = "study.db", "trials"
#: Seconds between a running trial's heartbeats, and the age at which another machine's tuner takes
#: a trial whose heartbeat stopped for dead.
HEARTBEAT_S, GRACE_S = 20, 120
#: How long a resumed trial waits for the fit of its interrupted attempt to write last.pt and end.
FREE_WAIT_S = 300
#: Attempts to open the storage (see ``connect``).
CONNECT_TRIES = 4
PRUNERS = ("median", "halving", "none")
#: Optuna's attributes of a trial, as this module keeps them.
RUN_DIR_ATTR, RESUMES_ATTR, TUNER_ATTR, SURPLUS_ATTR, FAILURE_ATTR = "run_dir", "resumes", "tuner", "surplus", "failure"
#: A trial's number as the user sees it: its run dir's (trial-NNNN), the same for every attempt.
TRIAL_ATTR = "trial"


@dataclasses.dataclass
class TuneSettings:
    """The ``visiontrain tune`` command line."""

    recipe: str
    space: str
    trials: int
    study_dir: Path
    overrides: list[str] = dataclasses.field(default_factory=list)
    storage: str | None = None
    study_name: str | None = None
    jobs: int = 1
    pruner: str = "median"
    metric: str | None = None
    seed: int | None = None
    imports: list[str] = dataclasses.field(default_factory=list)

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.study_dir / STUDY_DB).absolute()}"

    def name(self) -> str:
        return self.study_name or self.study_dir.absolute().name


@dataclasses.dataclass
class Search:
    """What every job of a tuner shares: the settings, the study, and how to stop."""

    settings: TuneSettings
    space: list[Param]
    objective: Objective
    study: Any
    overrides: list[str]
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    ask_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    errors: list[str] = dataclasses.field(default_factory=list)
    signum: int | None = None
    #: Called (under a lock) after each trial this tuner ran has been told: the study's files.
    after_trial: Callable[[Any, Outcome, Path], None] | None = None
    files_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def prepare(s: TuneSettings) -> Search:
    """Check the space against the recipe, open (or create) the study: every error here comes before
    any trial starts."""
    if s.trials < 1 or s.jobs < 1:
        raise C.ConfigError(f"--trials {s.trials} --jobs {s.jobs}: both must be at least 1")
    if s.pruner not in PRUNERS:
        raise C.ConfigError(f"--pruner {s.pruner!r}: expected one of {', '.join(PRUNERS)}")
    overrides = [*s.overrides, *([f"eval.metric={s.metric}"] if s.metric else [])]
    space = read_space(s.space)
    cfg = check_against(space, s.space, s.recipe, overrides)
    task_class = registered_task(cfg.task.name).task_class
    objective = Objective(cfg.eval.metric or task_class.metric, cfg.eval.mode or task_class.mode)
    s.study_dir.mkdir(parents=True, exist_ok=True)
    study = open_study(s, objective, space, overrides)
    return Search(s, space, objective, study, [*overrides, *tracking_overrides(cfg, s)])


def tracking_overrides(cfg: C.Config, s: TuneSettings) -> list[str]:
    """With ``logging.mlflow``, every trial goes to one MLflow store and experiment, the study's,
    unless the recipe names them: the trials are then runs side by side in MLflow's UI."""
    if not cfg.logging.mlflow:
        return []
    out = []
    if cfg.logging.mlflow_uri is None:
        out.append(f"logging.mlflow_uri=sqlite:///{(s.study_dir / MLFLOW_DB_FILE).absolute()}")
    if cfg.logging.mlflow_experiment is None:
        out.append(f"logging.mlflow_experiment={s.name()}")
    return out


def require_optuna() -> Any:
    """The optuna module, or a ConfigError that says how to install it."""
    try:
        import optuna
    except ImportError as err:
        raise C.ConfigError(f"visiontrain tune needs Optuna, which cannot be imported ({err}): "
                            f"pip install 'visiontrain[tune]'") from None
    return optuna


def open_study(s: TuneSettings, objective: Objective, space: list[Param], overrides: list[str]) -> Any:
    optuna = require_optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the tuner says what happens, once
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # the heartbeat is recorded by this module's jobs (``Heartbeat``), not by Study.optimize
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    url = s.storage_url()
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # tuners wait for each other
    pruner = {"median": optuna.pruners.MedianPruner(n_startup_trials=2),
              "halving": optuna.pruners.SuccessiveHalvingPruner(),
              "none": optuna.pruners.NopPruner()}[s.pruner]
    # Tuners started at once on one machine would all create the database's tables: one at a time.
    with open(s.study_dir / ".study.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        storage = connect(optuna, url, kwargs)
        study = optuna.create_study(storage=storage, study_name=s.name(), direction=objective.direction,
                                    sampler=optuna.samplers.TPESampler(seed=s.seed), pruner=pruner,
                                    load_if_exists=True)
        if s.seed is not None:  # a continued study draws on from where it is, not its first trials again
            study.sampler = optuna.samplers.TPESampler(seed=s.seed + len(study.get_trials(deepcopy=False)))
        same_search(study, s, {"recipe": s.recipe, "overrides": overrides, "metric": objective.metric,
                               "mode": objective.mode, "space": [dataclasses.asdict(p) for p in space]})
    return study


def connect(optuna: Any, url: str, engine_kwargs: dict[str, Any] | None) -> Any:
    """The study's storage. Tuners on several machines that start at once against a new database
    all create its tables, and the ones that lose the race get an error: they try again, and find
    the tables made. A URL that still cannot be opened is a ConfigError naming it (no password)."""
    import sqlalchemy.exc

    for attempt in range(CONNECT_TRIES):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S,
                                              grace_period=GRACE_S, heartbeat_stale_trial_callback=resume_later)
        except (sqlalchemy.exc.SQLAlchemyError, ImportError) as err:
            if attempt == CONNECT_TRIES - 1 or isinstance(err, ImportError):  # a missing driver stays missing
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                first = scrub(first, url)  # a driver may quote the URL it could not parse
                first += missing_driver(err, url)
                raise C.ConfigError(f"--storage {redact_url(url)}: cannot open the study's database: {first}") from None
            time.sleep(1.0 + attempt)
    raise AssertionError("unreachable")


def missing_driver(err: Exception, url: str) -> str:
    """Which module a storage URL's driver lacks, and for PostgreSQL the package that has it: Optuna's
    own message names neither."""
    cause = err.__cause__
    if not isinstance(err, ImportError) or not isinstance(cause, ImportError):
        return ""
    hint = "; pip install 'psycopg[binary]'" if url.startswith("postgresql") and cause.name == "psycopg" else ""
    return f" ({cause}{hint})"


def same_search(study: Any, s: TuneSettings, definition: dict[str, Any]) -> None:
    """A study continues only the search it was started with: another recipe, override, metric or
    space would mix trials of two searches in one ranking."""
    stored = study.user_attrs.get("search")
    here = json.loads(json.dumps(definition))  # as stored: tuples become lists
    if stored is None:
        study.set_user_attr("search", here)
        return
    changed = [k for k in here if stored.get(k) != here[k]]
    if changed:
        was = ", ".join(f"{k}: {stored.get(k)!r}" for k in changed)
        raise C.ConfigError(f"study {s.name()!r} in {redact_url(s.storage_url())} was started with another "
                            f"{', '.join(changed)} ({was}): continue it with the same command, or start a new "
                            f"study (another --study-dir or --study-name)")


# ---------------------------------------------------------------------- trials whose tuner died
def trial_number(trial: Any) -> int:
    """The trial's number in every line, file and table the user reads: the number of its run dir
    (``trials/trial-NNNN``). Optuna numbers each attempt; an interrupted trial continued by a later
    attempt keeps its first attempt's number, so a trial and its run dir are never told apart.
    (A number left out of the list is an attempt that a later one continued.)"""
    return trial.user_attrs.get(TRIAL_ATTR, trial.number)


def resume_later(study: Any, trial: Any) -> None:
    """Enqueue a failed trial again, with its parameters, run dir and number: the next trial started
    continues it. (Optuna's heartbeat check calls this for a stale trial of any machine.)"""
    study.enqueue_trial(trial.params, user_attrs={RESUMES_ATTR: trial.number, TRIAL_ATTR: trial_number(trial),
                                                  RUN_DIR_ATTR: trial.user_attrs.get(RUN_DIR_ATTR)})


def this_tuner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    """A process's start time (Linux), so that a new process given a dead tuner's pid is told apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _gone(owner: dict[str, Any]) -> bool:
    """Whether a trial's tuner, on this machine, no longer runs."""
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return owner.get("started") is not None and _start_time(pid) != owner.get("started")


def claim_orphans(search: Search) -> None:
    """Fail and enqueue again the running trials whose tuner is gone: on this machine by its pid,
    elsewhere by its heartbeat. Two tuners never both claim one: the state change is atomic."""
    import optuna
    from optuna.trial import TrialState

    study = search.study
    optuna.storages.fail_stale_trials(study)
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get(TUNER_ATTR) or {}
        if owner.get("host") != host or not _gone(owner):
            continue
        try:
            claimed = study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        if claimed:
            log.info(f"visiontrain: trial {trial_number(trial)}: its tuner (pid {owner['pid']}) is gone: "
                     f"it will be resumed")
            resume_later(study, trial)


def counted(trials: list[Any]) -> list[Any]:
    """The trials ``--trials`` counts: all but the failed ones that were resumed, and the surplus."""
    from optuna.trial import TrialState

    resumed = {t.user_attrs.get(RESUMES_ATTR) for t in trials}
    return [t for t in trials if not t.user_attrs.get(SURPLUS_ATTR)
            and not (t.state == TrialState.FAIL and t.number in resumed)]


# ---------------------------------------------------------------------- the search
def next_trial(search: Search) -> Any | None:
    """The next trial to run (a resume first), or None when the study has its trials. Tuners that ask
    at once may make one trial too many: the later one is told failed as surplus, never run."""
    from optuna.trial import TrialState

    study, n = search.study, search.settings.trials
    with search.ask_lock:
        claim_orphans(search)
        trials = study.get_trials(deepcopy=False)
        if not any(t.state == TrialState.WAITING for t in trials) and len(counted(trials)) >= n:
            return None
        trial = study.ask()
        trial.set_user_attr(TUNER_ATTR, this_tuner())
        study._storage.record_heartbeat(trial._trial_id)
        if RESUMES_ATTR not in trial.user_attrs:
            before = [t for t in counted(study.get_trials(deepcopy=False)) if t.number < trial.number]
            if len(before) >= n:
                trial.set_user_attr(SURPLUS_ATTR, True)
                study.tell(trial, state=TrialState.FAIL)
                return None
        return trial


def run_one(search: Search, trial: Any, cores: list[int] | None) -> Outcome:
    """Draw the trial's parameters, run it, tell the study how it ended."""
    s = search.settings
    params = {p.key: p.suggest(trial) for p in search.space}
    n = trial_number(trial)
    rel = trial.user_attrs.get(RUN_DIR_ATTR) or f"{TRIALS_DIR}/trial-{n:04d}"
    trial.set_user_attr(RUN_DIR_ATTR, rel)
    trial.set_user_attr(TRIAL_ATTR, n)
    run_dir = s.study_dir / rel
    resumed = "resumed " if RESUMES_ATTR in trial.user_attrs else ""
    log.info(f"visiontrain: trial {n} {resumed}in {run_dir}: {' '.join(override(k, v) for k, v in params.items())}")
    wait_free(run_dir, search.stopping)
    overrides = [*search.overrides, *(override(k, v) for k, v in params.items())]
    process = TrialProcess(fit_command(s.recipe, overrides, run_dir, s.imports), run_dir, trial_env(cores), cores)
    metric = search.objective.metric
    watch = Watch(trial, run_dir, search.objective,
                  lambda step, v: log.info(f"visiontrain: trial {n}: step {step}: {metric} {v:.6g}"))
    beat = Heartbeat(search.study._storage, trial._trial_id)
    outcome = run_trial(process, watch, search.stopping, beat)
    tell(search, trial, outcome)
    if search.after_trial is not None:
        with search.files_lock:
            search.after_trial(trial, outcome, run_dir)
    return outcome


class Heartbeat:
    """Records a running trial's heartbeat every ``HEARTBEAT_S``: a tuner on another machine takes a
    trial whose heartbeat stopped for interrupted."""

    def __init__(self, storage: Any, trial_id: int) -> None:
        self.storage, self.trial_id, self.last = storage, trial_id, time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last >= HEARTBEAT_S:
            self.storage.record_heartbeat(self.trial_id)
            self.last = time.monotonic()


def wait_free(run_dir: Path, stopping: threading.Event) -> None:
    """A resumed trial's run dir may still be held by its interrupted fit, writing its last.pt."""
    deadline = time.monotonic() + FREE_WAIT_S
    while True:
        try:
            check_free(run_dir)
            return
        except RunDirBusy:
            if time.monotonic() > deadline or stopping.is_set():
                raise
            time.sleep(1.0)


def tell(search: Search, trial: Any, outcome: Outcome) -> None:
    from optuna.trial import TrialState

    study, n, metric = search.study, trial_number(trial), search.objective.metric
    if outcome.state == COMPLETE:
        study.tell(trial, outcome.value)
        log.info(f"visiontrain: trial {n} complete: {metric} {outcome.value:.6g}")
        return
    if outcome.state == PRUNED:
        study.tell(trial, state=TrialState.PRUNED)
        log.info(f"visiontrain: trial {n} {outcome.reason} ({metric} {outcome.value:.6g}); its last.pt is written")
        return
    trial.set_user_attr(FAILURE_ATTR, outcome.reason)
    if outcome.state == INTERRUPTED:
        resume_later(study, study._storage.get_trial(trial._trial_id))
    study.tell(trial, state=TrialState.FAIL)
    log.info(f"visiontrain: trial {n} {'interrupted' if outcome.state == INTERRUPTED else 'failed'}: {outcome.reason}")
    if outcome.state == USAGE:
        search.errors.append(f"trial {n} ({search.settings.study_dir / trial.user_attrs[RUN_DIR_ATTR]}): "
                             f"{outcome.reason}")
        search.stopping.set()


def work(search: Search, cores: list[int] | None) -> None:
    """One job: trials one after another, on the job's ``cores``, until the study has its trials or the
    tuner stops."""
    try:
        while not search.stopping.is_set():
            trial = next_trial(search)
            if trial is None:
                return
            run_one(search, trial, cores)
    except Exception as err:  # noqa: BLE001 - the main thread reports it and stops the other jobs
        search.errors.append(f"{type(err).__name__}: {err}")
        search.stopping.set()


def run_search(search: Search) -> None:
    """Run ``--jobs`` jobs until the study has its trials; a stop signal stops every trial (each writes
    its last.pt and is enqueued to be resumed) and then raises Preempted."""
    jobs = search.settings.jobs
    # Each job's trials run on cores of their own (their affinity), so what a fit chooses from its cores
    # (threads, data.num_workers=auto) is its share: four trials of a 16-core machine take 4 each, not 16.
    cores = shares(affinity(), jobs) if jobs > 1 else [None]

    def stop(signum: int, _frame: Any) -> None:
        search.signum = signum
        search.stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        workers = [threading.Thread(target=work, args=(search, cores[i]), name=f"visiontrain-tune-{i}")
                   for i in range(jobs)]
        for w in workers:
            w.start()
        for w in workers:
            while w.is_alive():
                w.join(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if search.errors:
        raise C.ConfigError("; ".join(search.errors))
    if search.signum is not None:
        raise Preempted(f"stopped by {signal.Signals(search.signum).name}: each running trial wrote its last.pt "
                        f"and will be resumed by the same command", search.signum)
