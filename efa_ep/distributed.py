"""Launch several ranks as local processes (gloo or NCCL over 127.0.0.1), with deadlines.

Used by the tests, the loss-match command, the benchmark and the built-in GRPO trainer, so one
command can start its own ranks. Every wait is bounded: a rank that dies or never reports is
named in the error, and the others are killed.

Nothing listens beyond loopback: the rendezvous store is served by the launcher on a socket it
binds to 127.0.0.1 itself (torch's ``TCPStore`` server would listen on every interface), and
gloo is pointed at the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise.

Ctrl-C: a SIGINT that reaches the launching process while it starts the ranks is held until the
last one has started, then raised, so the cleanup knows every rank to stop (none is left
half-started). With ``ranks_block_sigint`` the ranks start with SIGINT blocked and never see it
(see :func:`run_ranks`).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_mod
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """One or more ranks raised, died, or missed the deadline.

    Attributes:
        failures: ``[(rank, text)]`` of the failed ranks in the order their failures reached
            the launcher (``text``: ``"Type: message"`` then the traceback); the first is
            usually the cause, the others its consequences (peers seeing it die).
    """

    def __init__(self, message: str, failures=()):
        super().__init__(message)
        self.failures = list(failures)


LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_store(timeout_s: float):
    """A ``TCPStore`` server listening on 127.0.0.1 only, on a free port.

    torch's ``TCPStore(host, port, is_master=True)`` binds the wildcard address whatever
    ``host`` says; handing it a socket we bound ourselves (``master_listen_fd``) confines it to
    loopback, and holding the socket from bind to serve closes the race of ``free_port``.

    Returns:
        (store, port). Keep ``store`` alive while ranks use it.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # The store takes ownership of the descriptor (it closes it); detach so Python does not.
    store = dist.TCPStore(LOOPBACK, port, None, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def _loopback_ifname() -> Optional[str]:
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else None


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose launcher died (killed by a timeout, say) exits instead of spinning on."""
    import threading

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="efa-ep-parent-watch").start()


def _child(fn, rank, world_size, port, backend, pg_timeout_s, env, args, result_q, parent_pid):
    _exit_with_parent(parent_pid)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    lo = _loopback_ifname()
    if lo and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = lo  # gloo's pairs listen where the ranks talk
    import torch.distributed as dist

    try:
        if backend:
            # A client of the launcher's loopback store (init_method=tcp:// would make rank 0
            # serve a store on every interface).
            timeout = datetime.timedelta(seconds=pg_timeout_s)
            store = dist.TCPStore(LOOPBACK, port, None, False, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        out = fn(rank, world_size, *args)
        result_q.put((rank, True, out))
    except BaseException as e:  # report every failure to the parent, with the traceback
        result_q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if backend and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


@contextlib.contextmanager
def _starting_ranks(block_sigint: bool):
    """Around the start of the ranks (main thread only; elsewhere nothing): a SIGINT is held
    (recorded, not raised) and handed to the previous Python handler afterwards (by default:
    KeyboardInterrupt), so the caller's cleanup sees every started rank. With ``block_sigint``
    SIGINT is also blocked meanwhile, and each rank process inherits that mask at spawn.

    Yields a function to call before each start: it blocks SIGINT again, in case something
    (multiprocessing's resource tracker, when it is restarted) unblocked it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    previous = signal.getsignal(signal.SIGINT)
    held = []
    if callable(previous):
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))

    def block():
        if block_sigint:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:
        yield block
    finally:
        # Handler first, then the mask: a SIGINT pending on this thread arrives at the handler.
        if callable(previous):
            signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if held:
        previous(signal.SIGINT, held[0])


def run_ranks(fn: Callable, world_size: int, args: Sequence[Any] = (), *, backend: Optional[str] = "gloo",
              timeout_s: float = 300.0, pg_timeout_s: float = 60.0,
              env: Optional[Dict[str, str]] = None, raise_on_error: bool = True,
              ranks_block_sigint: bool = False) -> List[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        backend: ``gloo``/``nccl`` to initialise the default process group first, None for none.
        timeout_s: deadline for all ranks to report. pg_timeout_s: the process group's timeout,
            which bounds every collective inside ``fn``.
        env: extra environment variables for the children.
        raise_on_error: raise RankFailure if any rank failed; otherwise return per-rank
            ``(ok, value_or_traceback)`` tuples.
        ranks_block_sigint: start the ranks with SIGINT blocked (a mask survives spawn's exec),
            for a launcher that handles Ctrl-C itself: a terminal's Ctrl-C reaches the whole
            process group, and a rank would otherwise die at whatever it was doing, or, before
            it could install a handler, with a traceback; a blocked signal also never reaches
            a handler a library installs later (libfabric's ends the process with status 1).
            On KeyboardInterrupt here the ranks are killed.

    Returns:
        Per-rank return values (rank order), or ``(ok, value)`` tuples when not raising.
    """
    ctx = mp.get_context("spawn")
    result_q = ctx.Queue()
    store = None
    if backend:
        store, port = loopback_store(max(timeout_s, pg_timeout_s))
    else:
        port = free_port()
    procs = [ctx.Process(target=_child, daemon=False,
                         args=(fn, r, world_size, port, backend, pg_timeout_s, dict(env or {}),
                               tuple(args), result_q, os.getpid()))
             for r in range(world_size)]
    results: Dict[int, tuple] = {}
    try:
        with _starting_ranks(ranks_block_sigint) as block_sigint:
            for p in procs:
                block_sigint()
                p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, val = result_q.get(timeout=min(left, 1.0))
                results[rank] = (ok, val)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in results and p.exitcode is not None]
                if dead:
                    # Give a dying rank's last message a moment to arrive through the queue.
                    time.sleep(0.5)
                    while True:
                        try:
                            rank, ok, val = result_q.get_nowait()
                            results[rank] = (ok, val)
                        except queue_mod.Empty:
                            break
                    for r in dead:
                        results.setdefault(r, (False, f"process exited with code {procs[r].exitcode} "
                                                      f"without reporting"))
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            p.join(timeout=5 if len(results) == world_size else 0.1)
        for p in started:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store  # the ranks are gone: stop serving
    missing = [r for r in range(world_size) if r not in results]
    for r in missing:
        results[r] = (False, f"rank {r} did not report within {timeout_s:.0f}s (killed)")
    ordered = [results[r] for r in range(world_size)]
    if raise_on_error and not all(ok for ok, _ in ordered):
        msgs = "\n".join(f"--- rank {r} ---\n{val}" for r, (ok, val) in enumerate(ordered) if not ok)
        raise RankFailure(f"ranks {[r for r, (ok, _) in enumerate(ordered) if not ok]} failed:\n{msgs}",
                          failures=[(r, val) for r, (ok, val) in results.items() if not ok])
    return [val for _, val in ordered] if raise_on_error else ordered
