import sys

import nemo_rl


class PY_EXECUTABLES:
    SYSTEM = sys.executable
    MCORE = "uv run --locked --extra mcore --directory <nemo-rl>"


def init_ray(log_dir=None):
    nemo_rl.CALLS.append(("init_ray",))
