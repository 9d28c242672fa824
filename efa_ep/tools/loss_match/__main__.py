"""``python -m efa_ep.tools.loss_match``: the same as ``efa-ep-loss-match``."""
import sys

from .cli import main

sys.exit(main())
