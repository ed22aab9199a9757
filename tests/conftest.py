import sys
from pathlib import Path

# Shared test helpers (tiny_run.py) live beside this file.
sys.path.insert(0, str(Path(__file__).parent))
