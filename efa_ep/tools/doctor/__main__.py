"""``python -m efa_ep.tools.doctor``: the same as ``efa-ep-doctor``."""
import sys

from .cli import main

sys.exit(main())
