"""launch/train.py whose process waits SLOW_EXIT_S seconds after ft-train returns, then exits with its
code: a rank slower to exit than its peers, as one is on a loaded machine. With it the race between
one node's launcher exiting and another's seeing its own workers' exits happens every time
(tests/multinode/test_multinode_failures.py)."""

import os
import time

from ft_framework.cli import train_main

if __name__ == "__main__":
    code = train_main()
    time.sleep(float(os.environ["SLOW_EXIT_S"]))
    raise SystemExit(code)
