#!/usr/bin/env python
"""Rebase a run: materialise its head from the base and chain, store it as a snapshot, advance the base.

    scripts/rebase.py s3://bucket/run [--storage-options JSON]

Same as `deltarelay rebase`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relay.cli import main

if __name__ == "__main__":
    sys.exit(main(["rebase", *sys.argv[1:]]))
