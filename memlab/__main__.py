"""``python -m memlab``: the same as the ``memlab`` command."""

from __future__ import annotations

import sys

from memlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
