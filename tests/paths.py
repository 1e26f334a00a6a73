"""Where the tests' shared files are, whichever folder a test module sits in."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
DATA = TESTS / "data"
REPO = TESTS.parent
