"""Where the tests' shared files are, for tests in any folder below parity_tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
VECTORS = ROOT / "parity_tests" / "vectors"  # the stored parity vectors
DATA = ROOT / "parity_tests" / "data"  # small committed models (tiny-bert)
