#!/usr/bin/env python3
"""Thin entry point: ``python scripts/loss_match.py [--config-name cpu] [overrides...]``.

Same as the ``efa-ep-loss-match`` console script; see :mod:`efa_ep.tools.loss_match`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from efa_ep.tools.loss_match import main

    sys.exit(main())
