"""``python -m rdzv.torchrun serve PORT [options]``: the ``rdzv`` backend's store server child."""

import sys

from rdzv.torchrun.server_child import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
