"""`python -m batchkv`: the `batchkv` command."""

import sys

from batchkv.cli import main

if __name__ == "__main__":  # not when a spawned child (the engine process) imports this as its parent's main
    sys.exit(main())
