"""Shared test fixtures: one loaded model per session, factories for engines.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, first.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
