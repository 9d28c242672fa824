#!/usr/bin/env python3
"""Benchmarks of the ``proxy`` transport: round trip, issue rate per channel count, dispatch +
combine next to its own wire floor and gloo (see :mod:`efa_ep.tools.bench.proxy`).

    python scripts/bench_proxy.py --out runs/bench_proxy [--providers tcp,shm] [--iters 30]
"""
import sys

from efa_ep.tools.bench.proxy import main

if __name__ == "__main__":
    sys.exit(main())
