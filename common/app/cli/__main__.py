"""`python -m common.app.cli ...`: the same as `rosetta ...`, through the same entry point
(common/app/launch.py), so that a signal during start-up is handled alike."""

import sys

from common.app.launch import main

if __name__ == "__main__":
    sys.exit(main())
