"""``python -m app.evaluate RUN_DIR_OR_CHECKPOINT``: see app/evaluate/cli.py."""

import sys

from app.evaluate.cli import main

sys.exit(main())
