"""`python -m batchkv.cli`: the `batchkv` command."""

import sys

from batchkv.cli import main

sys.exit(main())
