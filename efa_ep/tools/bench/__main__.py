"""``python -m efa_ep.tools.bench``: the same as ``efa-ep-bench``."""
import sys

from .cli import main

sys.exit(main())
