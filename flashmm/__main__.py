"""``python -m flashmm ...``: the ``flashmm`` command line (flashmm.cli)."""
import sys

from .cli import main

sys.exit(main())
