"""``python -m healthagent`` is the same as the ``healthagent`` console script."""

import sys

from healthagent.cli import main

sys.exit(main())
