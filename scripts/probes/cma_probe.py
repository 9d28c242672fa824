#!/usr/bin/env python3
"""Can two sibling processes on this host read each other's memory with process_vm_readv (CMA)?

libfabric's shm provider moves large messages with CMA when it can (one copy by the receiver);
Yama's ptrace_scope=1 (a common default) forbids it between siblings, and the provider then falls
back to copying through shared bounce buffers. Prints ptrace_scope and the probe's result.

    python3 scripts/probes/cma_probe.py
"""
import ctypes
import multiprocessing as mp
import os


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _holder(q, done):
    buf = ctypes.create_string_buffer(b"cma-probe-payload", 64)
    q.put((os.getpid(), ctypes.addressof(buf)))
    done.wait(30)


def _reader(q, out):
    pid, addr = q.get()
    libc = ctypes.CDLL(None, use_errno=True)
    dst = ctypes.create_string_buffer(64)
    local, remote = _IoVec(ctypes.addressof(dst), 17), _IoVec(addr, 17)
    n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    out.put("ok" if n == 17 and dst.raw[:17] == b"cma-probe-payload"
            else f"failed: {os.strerror(ctypes.get_errno())}")


def main():
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = f.read().strip()
    except OSError:
        scope = "n/a (no Yama)"
    ctx = mp.get_context("spawn")
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    a, b = ctx.Process(target=_holder, args=(q, done)), ctx.Process(target=_reader, args=(q, out))
    a.start(); b.start()
    res = out.get(timeout=30)
    done.set(); a.join(); b.join()
    print(f"ptrace_scope={scope}; process_vm_readv between sibling processes: {res}")


if __name__ == "__main__":
    main()
