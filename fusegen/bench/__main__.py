"""python -m fusegen.bench: the same as `fusegen bench`."""

import sys

from fusegen.bench.command import main

sys.exit(main())
