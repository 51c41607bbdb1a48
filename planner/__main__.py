"""``python -m planner``: see ``planner/cli.py`` or run ``python -m planner --help``."""

import sys

from planner.cli import main

sys.exit(main())
