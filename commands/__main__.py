"""``python -m gradwatch.commands ...`` is ``gradwatch ...``."""

import sys

from .cli import main

sys.exit(main())
