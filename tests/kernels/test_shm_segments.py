"""Stale libfabric shm segments are removed only for dead processes of this user."""
import os
import subprocess
import sys

from efa_ep.kernels.shm_segments import remove_stale_segments


def test_removes_only_dead_processes_segments(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    live = str(os.getpid())
    for name in (f"{dead}:0:0", f"{dead}:1:0", f"{live}:0:0", "sem.mp-abc", "123x:0:0"):
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_segments(str(tmp_path))
    assert sorted(removed) == sorted([f"{dead}:0:0", f"{dead}:1:0"])
    assert sorted(os.listdir(tmp_path)) == sorted([f"{live}:0:0", "sem.mp-abc", "123x:0:0"])
    assert remove_stale_segments(str(tmp_path / "missing")) == []
