"""``python -m kinference.loadgen.bench``: ``kinference bench``."""

import sys

from kinference.loadgen.bench.bench import main

sys.exit(main(sys.argv[1:]))
