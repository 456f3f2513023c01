#!/usr/bin/env bash
# One-step set-up for a fresh machine, then either the default recipe or the test suite.
#
#   bash scripts/setup.sh fit    # set up, then train the default recipe into runs/classify-fashion-<time>
#   bash scripts/setup.sh test   # set up, then run the test suite
#   bash scripts/setup.sh        # set up only
#
# Idempotent: a stamp of pyproject.toml + constraints.txt (one per set of extras) skips pip when
# nothing changed. torch is installed first and pinned through constraints.txt so that no package
# can pull in a CUDA build of torch on a CPU-only machine. `test` also installs the mlflow and tune
# extras, so the suite tests the MLflow tracker and `visiontrain tune` for real; `fit` needs neither.
# (The test extra holds PostgreSQL's driver; as root, `test` installs Debian's postgresql server too.)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VISIONTRAIN_VENV:-$root/.venv}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating virtual environment $venv"
  "$py" -m venv "$venv"
fi
extras=test
if [ "${1:-}" = test ]; then extras=test,mlflow,tune; fi
stamp="$venv/.visiontrain-stamp-${extras//,/-}"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
full="$venv/.visiontrain-stamp-test-mlflow-tune"  # a venv set up for the tests has everything fit needs
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && [ "$(cat "$full" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing packages (torch first, then the rest under constraints.txt)"
  torch_pin="$(grep -E '^torch==' constraints.txt)"
  "$venv/bin/pip" install -q --disable-pip-version-check "$torch_pin"
  "$venv/bin/pip" install -q --disable-pip-version-check -c constraints.txt -e ".[$extras]"
  # deepforest ships the NEON tree photos and boxes; its own requirements would pull a CUDA torch.
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$(grep -E '^deepforest==' constraints.txt)"
  echo "$want" > "$stamp"
else
  echo "[setup] packages up to date"
fi

# panopticapi's pq_compute is the reference of the panoptic metric's tests (tests/evaluation/test_panoptic_metrics.py).
# Its wheel (panopticapi-lite) asks for numpy<2, which its evaluation code does not need (numpy and PIL
# only) and which would clash with ours: --no-deps, and outside the extras, where pip would refuse it.
if [ "${1:-}" = test ] && ! "$venv/bin/python" -c "import panopticapi.evaluation" 2>/dev/null; then
  echo "[setup] installing panopticapi-lite (the panoptic tests' reference)"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$(grep -E '^panopticapi-lite==' constraints.txt)"
fi

# Fashion-MNIST ships as a Debian package; elsewhere visiontrain falls back to torchvision's download.
fmnist=/usr/share/datasets/fashion-mnist
if [ ! -f "$fmnist/train-images-idx3-ubyte.gz" ] && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] installing Debian package dataset-fashion-mnist"
    apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "[setup] not root: skipping dataset-fashion-mnist (fit will try torchvision's download)"
  fi
fi

# Headless Chromium renders the HTML of `visiontrain report` in the tests (tests/report/test_report.py).
if [ "${1:-}" = test ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] installing Debian package chromium (the report test renders its page)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "[setup] not root: skipping chromium (the report rendering test will be skipped)"
  fi
fi

# A PostgreSQL server for the tests of `tune --storage postgresql://` (tests/tune/test_tune.py starts a
# throwaway one with initdb and pg_ctl, which Debian keeps in /usr/lib/postgresql/*/bin).
if [ "${1:-}" = test ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[setup] no apt-get: install PostgreSQL's server yourself (the tune test on a PostgreSQL study will be skipped)"
  elif [ "$(id -u)" != 0 ]; then
    echo "[setup] not root: skipping postgresql (the tune test on a PostgreSQL study will be skipped)"
  else
    echo "[setup] installing Debian package postgresql (the tune tests run a study on a real server)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
fi

# Runs are faster with glibc keeping freed memory instead of returning it to the OS on every batch.
export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=536870912

case "${1:-}" in
  fit)  shift; exec "$venv/bin/visiontrain" fit classify-fashion --run-dir "runs/classify-fashion-$(date +%Y%m%d-%H%M%S)" "$@" ;;
  # Two workers, each file on one of them (its module fixtures built once): most tests run one
  # thread and wait on subprocesses, so two at a time fill 2 cores (VISIONTRAIN_TEST_WORKERS=1: serial).
  test) shift; exec "$venv/bin/python" -m pytest -q -n "${VISIONTRAIN_TEST_WORKERS:-2}" --dist loadfile "$@" ;;
  "")   echo "[setup] done: activate with 'source $venv/bin/activate'" ;;
  *)    echo "usage: bash scripts/setup.sh [fit|test] [extra args]" >&2; exit 2 ;;
esac
