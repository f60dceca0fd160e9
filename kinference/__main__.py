"""``python -m kinference``: the same as the ``kinference`` command."""

import sys

from kinference.cli import main

sys.exit(main())
