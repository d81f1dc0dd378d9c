"""A worker that fails under torch's ``@record``: ``record_worker.py MESSAGE``."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record


def fail(message: str) -> None:
    raise ValueError(message)


@record
def main() -> None:
    fail(sys.argv[1])


if __name__ == "__main__":
    main()
