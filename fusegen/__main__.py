"""python -m fusegen: the same as the fusegen command."""

import sys

from fusegen.tools.cli import main

sys.exit(main())
