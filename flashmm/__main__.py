"""``python -m flashmm ...``: the ``flashmm`` command line (flashmm.serve.cli)."""
import sys

from .serve.cli import main

sys.exit(main())
