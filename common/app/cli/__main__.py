"""`python -m common.app.cli ...`: the same commands, output and exit codes as `rosetta ...`.

It calls main directly, not common/app/launch.py (which imports this package: the two would form
a cycle); launch.py adds only the one-line message for a signal that arrives while importing."""

import sys

from common.app.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
