import sys

from fusegen.bench.command import main

sys.exit(main())
