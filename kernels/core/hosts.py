"""Which host each rank runs on, and whether a peer process on this host still runs: the one
home of the host topology every transport and the ``auto`` choice use."""
from __future__ import annotations

import os
import socket
from typing import List, Optional, Tuple

import torch.distributed as dist


def host_id() -> str:
    """This host's identity: its name and boot id (a rebooted or cloned host differs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def device_identity():
    """(host, the current CUDA device's uuid), or None without CUDA: ranks with equal
    identities share one GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.cuda.current_device()
    return host_id(), str(getattr(torch.cuda.get_device_properties(dev), "uuid", dev))


def pid_exited(pid: int) -> bool:
    """True when ``pid`` (on this host) no longer runs: gone, or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False


def gather_hosts(group) -> List[str]:
    """Every rank's :func:`host_id`, in rank order (collective over ``group``)."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_id(), group=group)
    return hosts


def gather_processes(group) -> List[Tuple[str, int]]:
    """Every rank's ``(host_id, pid)``, in rank order (collective over ``group``): what a
    transport keeps to tell a peer that exited from one that is only slow."""
    peers = [None] * dist.get_world_size(group)
    dist.all_gather_object(peers, (host_id(), os.getpid()), group=group)
    return peers


def ranks_per_node(group, node_size: Optional[int] = None) -> int:
    """Ranks per host of ``group`` (collective over it unless ``node_size`` is given and fits);
    ``node_size`` emulates nodes."""
    world = dist.get_world_size(group)
    if node_size is not None and 0 < int(node_size) <= world:
        return int(node_size)
    hosts = gather_hosts(group)
    return max(hosts.count(h) for h in set(hosts))
