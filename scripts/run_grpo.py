#!/usr/bin/env python3
"""Thin entry point: ``python scripts/run_grpo.py --config <recipe.yaml> [overrides]``.

Same as the ``efa-ep-grpo`` console script (:mod:`efa_ep.recipes.launcher`); works from a plain
checkout without installing the package. A Ctrl-C that comes while the launcher is imported
(``import efa_ep`` loads torch: seconds) is held and handed to it, so it ends the run as one at
any later moment does (exit 130), instead of as a traceback, or not at all where the shell
started the command with SIGINT ignored.
"""
import os
import signal
import sys

if __name__ == "__main__":  # ranks are spawned processes: keep the launch under the guard
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from efa_ep.recipes.launcher import main

    sys.exit(main(sigint_held=held))
