#!/usr/bin/env python3
"""Thin entry point: ``python scripts/bench.py [--quick | --config-name gpu|gpu_nccl] [overrides...]``.

Same as the ``efa-ep-bench`` console script; see :mod:`efa_ep.tools.bench`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from efa_ep.tools.bench import main

    sys.exit(main())
