"""`python -m engine.bench`: run the benchmark."""

import sys

from engine.bench.cli import main

sys.exit(main())
