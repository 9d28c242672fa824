"""Stale shared-memory segments of libfabric's ``shm`` provider.

The provider names each endpoint's segment ``/dev/shm/<pid>:<n>:<m>`` and unlinks it when the
endpoint closes; a process killed with SIGKILL leaves its segments (16 MiB each) behind. The
proxy transport removes, when it starts an ``shm`` endpoint, the segments of processes that no
longer exist and belong to this user. Nothing else is touched: a live process's segment, a name
of another shape, or another user's file stays.
"""
from __future__ import annotations

import os
import re
from typing import List

_NAME = re.compile(r"^(\d+):\d+:\d+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_segments(directory: str = "/dev/shm") -> List[str]:
    """Unlinks ``<pid>:<n>:<m>`` files of dead processes owned by this user; returns their
    names. Errors (a segment removed meanwhile, no permission) are skipped: cleanup is best
    effort and must never fail a transport's start."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = _NAME.match(name)
        if not m or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    return removed
