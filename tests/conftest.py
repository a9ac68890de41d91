"""Shared test set-up: tests/ goes on sys.path so helpers like `memfixtures` import by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
