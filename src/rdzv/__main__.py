"""``python -m rdzv``: the ``rdzv`` command line."""

import sys

from rdzv.cli import main

if __name__ == "__main__":
    sys.exit(main())
