"""The client's tests run from this checkout (``client/`` on the path, as ``pip install ./client``
would put it) against the live stack of the root conftest: Daphne and a real worker with tiny
models loaded."""

import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[1]
if str(CLIENT) not in sys.path:
    sys.path.insert(0, str(CLIENT))
