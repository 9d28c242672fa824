"""efa-ep-doctor's multi-node mode: two torchrun agents on this host emulate two nodes (node ranks
0 and 1, one rank each, tcp on lo); rank 0 reports both nodes, the cross-node self-test of proxy
and hier against torch, and the verdict; the other agent prints nothing; exit codes agree. Plus
the environment detection and the agreement line on hand-built hosts."""
import os
import shutil
import subprocess
import sys

import pytest

from efa_ep.distributed import free_port
from efa_ep.tools.doctor import nodes

from test_doctor import _host

SMALL = ["selftest.tokens=16", "selftest.hidden=64", "selftest.iters=5", "selftest.warmup=1",
         "selftest.arm_budget_s=0.3", "selftest.timeout_s=30"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun():
    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def _two_agents(over0, over1, timeout=80):
    """Starts both agents, waits for both to exit (bounded); returns [(rc, stdout, stderr)] by node rank."""
    port = free_port()
    env = dict(os.environ, FI_TCP_IFACE="lo", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    procs = []
    for node, over in ((0, over0), (1, over1)):
        cmd = _torchrun() + ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                             "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "-m", "efa_ep.tools.doctor", *over]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def _quiet(stdout: str) -> bool:
    """Nothing but torchrun's own lines (warnings / launcher notices)."""
    return all(not ln.strip() or "torch.distributed" in ln or ln.startswith(("W", "I", "[")) for ln in
               stdout.splitlines()) and "doctor:" not in stdout and "cross-node" not in stdout


def test_two_nodes_ok():
    (rc0, o0, e0), (rc1, o1, e1) = _two_agents(SMALL, SMALL)
    assert rc0 == rc1 == 0, (o0, e0, o1, e1)
    assert "node 0 " in o0 and "node 1 " in o0, o0
    assert "ok    nodes agree" in o0
    for arm in ("proxy:tcp", "hier:tcp"):
        line = next(ln for ln in o0.splitlines() if ln.startswith(f"ok    cross-node {arm}"))
        assert "bit-identical" in line and "[M]" in line, line
    assert "ok    cross-node torch" in o0
    assert "verdict  advice:" in o0 and "doctor: ok=" in o0 and "fail=0" in o0
    assert _quiet(o1), o1


def test_two_nodes_bogus_provider_fails_everywhere():
    (rc0, o0, e0), (rc1, o1, e1) = _two_agents(SMALL, SMALL + ["+selftest.provider=bogus"])
    assert rc0 == rc1 == 1, (o0, e0, o1, e1)
    line = next(ln for ln in o0.splitlines() if "cross-node proxy:" in ln)
    assert line.startswith("fail"), line
    assert "fail=0" not in o0 and "advice: stay on alltoall" in o0, o0
    assert _quiet(o1), o1


def test_launch_env():
    assert nodes.launch_env({}) is None
    assert nodes.launch_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                             "MASTER_ADDR": "a", "MASTER_PORT": "1"}) is None
    le = nodes.launch_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": "a", "MASTER_PORT": "1", "GROUP_RANK": "1"})
    assert le["launcher"] == "torchrun" and le["rank"] == 3 and le["node_rank"] == 1 and le["local_rank"] == 1
    le = nodes.launch_env({"SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                           "MASTER_ADDR": "h0"})
    assert le["launcher"] == "slurm" and le["world"] == 16 and le["master_port"] == nodes.DEFAULT_PORT
    assert nodes.launch_env({"SLURM_NTASKS": "16", "SLURM_PROCID": "9"}) is None  # no MASTER_ADDR


def test_agreement_and_node_size():
    n0 = {"node_rank": 0, "host": "a"}
    n1 = {"node_rank": 1, "host": "b"}
    assert nodes.agreement_check([(n0, _host()), (n1, _host())]).status == "ok"
    c = nodes.agreement_check([(n0, _host()), (n1, _host(versions={"torch": "2.7.0", "triton": "3.9.0",
                                                                    "megatron-core": "0.19.2"}))])
    assert c.status == "fail" and "torch: 2.13.0 on node 0 (a), 2.7.0 on node 1 (b)" in c.detail and c.fix
    assert nodes.agreement_check([(n0, _host()), (n1, _host(gpus=4))]).status == "warn"
    tab = nodes.node_table([{"rank": r, "node_rank": r // 2, "host": "h"} for r in range(4)])
    assert [n["ranks"] for n in tab] == [[0, 1], [2, 3]] and nodes.node_size(tab) == (2, None)
    size, why = nodes.node_size(nodes.node_table([{"rank": r, "node_rank": r % 2, "host": "h"} for r in range(4)]))
    assert size is None and "consecutive" in why
    assert nodes.cross_shape({"tokens": 1, "hidden": 2, "num_experts": 6, "topk": 2, "dtype": "bf16"}, 4)[
        "num_experts"] == 8
