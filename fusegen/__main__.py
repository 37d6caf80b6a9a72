"""python -m fusegen: the same as the fusegen command."""

import sys

from .cli import main

sys.exit(main())
