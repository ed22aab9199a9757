"""ft-train (launch/train.py) with a handle for the elastic-restart test: on the first attempt of the
job (TORCHELASTIC_RESTART_COUNT=0), rank FT_TEST_PAUSE_RANK stops before its optimizer step
FT_TEST_PAUSE_AT_STEP + 1, writes its pid into FT_TEST_PAUSE_FILE and waits there, so the test can
kill -9 it mid-training at a known step. The other ranks block in that step's collectives, as they
would when a peer's node vanishes. Restarted attempts train untouched.
"""

import os
import sys
import time
from pathlib import Path

import ft_framework.trainer as trainer_module
from ft_framework.cli import train_main


def _install_pause() -> None:
    at, rank = int(os.environ["FT_TEST_PAUSE_AT_STEP"]), int(os.environ["FT_TEST_PAUSE_RANK"])
    pid_file = Path(os.environ["FT_TEST_PAUSE_FILE"])
    build = trainer_module.build_strategy

    def build_strategy(*args, **kwargs):
        strategy = build(*args, **kwargs)
        step = strategy.clip_and_step
        done = [0]

        def clip_and_step(*a, **k):
            if done[0] == at and strategy.rank == rank:
                pid_file.write_text(str(os.getpid()))
                time.sleep(600)  # killed here by the test
            out = step(*a, **k)
            done[0] += 1
            return out

        strategy.clip_and_step = clip_and_step
        return strategy

    trainer_module.build_strategy = build_strategy


if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _install_pause()
    sys.exit(train_main())
