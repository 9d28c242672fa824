#!/usr/bin/env python3
"""Thin entry point: ``python scripts/run_grpo.py --config <recipe.yaml> [overrides]``.

Same as the ``efa-ep-grpo`` console script (:mod:`efa_ep.recipes.launcher`); works from a plain
checkout without installing the package.
"""
import os
import sys

if __name__ == "__main__":  # ranks are spawned processes: keep the launch under the guard
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from efa_ep.recipes.launcher import main

    sys.exit(main())
