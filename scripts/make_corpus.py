#!/usr/bin/env python3
"""Build a benchmark corpus (`make corpora`): a thin wrapper over relay.lab.corpus, which does the work.

    python scripts/make_corpus.py --regime fp32-lr1e-6 --steps 6 --out corpus/minilm-fp32-lr1e-6

is `python -m relay.lab.corpus ...`; see that module for the corpus and its options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from relay.lab.corpus import main

if __name__ == "__main__":
    sys.exit(main())
