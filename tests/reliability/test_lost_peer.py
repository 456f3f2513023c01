"""Two nodes under torchrun (two agents on this machine, static rendezvous); one node's agent is
killed with SIGKILL mid-run. Its rank ends with it, and the surviving rank says in one line what was
lost, that last.pt is intact and how to continue, and exits with EXIT_PEER_LOST; its agent does not
wait torchrun's exit barrier."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from procs import alive, descendants, group, wait_for

from visiontrain.core.exit_codes import EXIT_PEER_LOST

# classify-fashion as shipped on the embedded digits, long enough to be killed while it trains
RUN = ["classify-fashion", "data.name=digits", "data.batch_size=32", "trainer.epochs=200", "trainer.progress=plain"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(rank: int, port: int, run_dir: Path) -> subprocess.Popen:
    """One node's agent: ``torchrun --nnodes 2 --node-rank RANK``, in a session of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "-m", "visiontrain", "fit", *RUN, "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def test_a_lost_node_is_one_line_and_no_wait(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    nodes = [node(0, port, run_dir), node(1, port, run_dir)]
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "last.pt").is_file(), "checkpoint", nodes[0])
        lost_rank = descendants(nodes[1].pid)
        os.kill(nodes[1].pid, signal.SIGKILL)  # node 1's agent alone: its rank must not go on without it
        start = time.monotonic()
        _, err = nodes[0].communicate(timeout=60)
        waited = time.monotonic() - start
        nodes[1].wait(10)
        end = time.monotonic() + 5
        while alive(lost_rank) and time.monotonic() < end:
            time.sleep(0.05)
        assert not alive(lost_rank), "node 1's rank outlived its agent"
    finally:
        for proc in nodes:
            for pid in group(proc.pid) | alive(descendants(proc.pid)):
                os.kill(pid, signal.SIGKILL)
            proc.wait(10)
            proc.stderr.close()
    ours = [line for line in err.splitlines() if line.startswith("visiontrain:")]
    assert len(ours) == 1, err[-3000:]
    line = ours[0]
    assert line.startswith("visiontrain: error: rank 0 lost another rank of the run (")
    assert f"{run_dir / 'checkpoints' / 'last.pt'} at step " in line and " is intact; " in line
    assert line.endswith("restart every node with --resume auto")
    assert f"exitcode: {EXIT_PEER_LOST}" in err  # torchrun's agent reports the rank's status
    assert "Traceback" not in err.split("exitcode:", 1)[0]  # the rank printed no traceback of its own
    assert waited < 30  # not torchrun's 300-s exit barrier


def ranks_of(launcher: int) -> list[int]:
    """The ranks `fit --nproc` started: the launcher's children that run visiontrain."""
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
    children = [pid for pid in descendants(launcher) if _parent(pid) == launcher]
    return sorted(pid for pid in children if b"-m\0visiontrain" in cmdline(pid))


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_a_rank_killed_under_fit_nproc_is_the_surviving_rank_s_line_and_status(tmp_path):
    """`fit --nproc 2` runs torchrun's agent in its own process. One rank killed with SIGKILL: the other
    says in its one line what was lost, and the launch ends with that rank's status, EXIT_PEER_LOST;
    torchrun's ChildFailedError traceback and its "Root Cause" summary no longer follow that line."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "visiontrain", "fit", *RUN, "--nproc", "2",
                             "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "last.pt").is_file() and len(ranks_of(proc.pid)) == 2,
                 "checkpoint", proc)
        os.kill(ranks_of(proc.pid)[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        for pid in group(proc.pid) | alive(descendants(proc.pid)):
            os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        proc.stderr.close()
    ours = [line for line in err.splitlines() if line.startswith("visiontrain:")]
    assert proc.returncode == EXIT_PEER_LOST and len(ours) == 1, err[-3000:]
    assert " lost another rank of the run (" in ours[0], ours
    for torchrun_s in ("Traceback", "ChildFailedError", "Root Cause", "exitcode"):
        assert torchrun_s not in err, err[-3000:]
