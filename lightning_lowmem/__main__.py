"""``python -m lightning_lowmem``: the command line (see :mod:`lightning_lowmem.cli`)."""

import sys

from lightning_lowmem.cli import main

if __name__ == "__main__":
    sys.exit(main())
