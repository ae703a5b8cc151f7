"""`python -m transformer_rosetta ...`: the same commands, output and exit codes as `rosetta ...`."""

import sys

from transformer_rosetta.launch import main

if __name__ == "__main__":
    sys.exit(main())
