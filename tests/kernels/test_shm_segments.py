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


def _start_shm_proxy(rank, world):
    import torch

    from efa_ep.kernels import create_transport

    t = create_transport("proxy", None, 8, 16, 8, torch.float32, provider="shm", num_channels=1,
                         timeout_s=20)
    t.close()
    return True


def test_shm_proxy_start_removes_a_killed_process_segment():
    import pytest

    from efa_ep.distributed import run_ranks
    from efa_ep.kernels import transport_status

    if transport_status().get("proxy") is not None or not os.path.isdir("/dev/shm"):
        pytest.skip("proxy over shm is not available here")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = f"/dev/shm/{dead}:0:0"
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        assert run_ranks(_start_shm_proxy, 2, (), timeout_s=180) == [True, True]
        assert not os.path.exists(stale)
    finally:
        if os.path.exists(stale):
            os.unlink(stale)
