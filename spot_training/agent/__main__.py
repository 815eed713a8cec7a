"""``python3 -m spot_training.agent <command> --config PATH``: see :mod:`spot_training.agent.cli`."""

import sys

from spot_training.agent.cli import main

sys.exit(main())
