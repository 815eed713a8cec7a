"""``python3 -m bootstrap <command> --config PATH``: see :mod:`bootstrap.cli`."""

import sys

from bootstrap.cli import main

sys.exit(main())
