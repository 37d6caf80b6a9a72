"""python -m fusegen.bench: the same as `fusegen bench`."""

import sys

from fusegen.bench.core import main

sys.exit(main())
