"""Where a cached load's time goes in a new process (run after `fusegen bench build`
has filled the cache, same FUSEGEN_CACHE_DIR): cProfile of `fusegen.fuse` of an op built
before, top entries by cumulative time.  python3 tests/gpu/load_probe.py EXPR NAME [SCALAR...]"""
import cProfile
import pstats
import sys
import time

import torch

t0 = time.perf_counter()
import fusegen  # noqa: E402

expr, name, *scalars = sys.argv[1:]
prof = cProfile.Profile()
t1 = time.perf_counter()
prof.enable()
op = fusegen.fuse(expr, name=name, scalars=scalars)
prof.disable()
t2 = time.perf_counter()
print(f"import fusegen {1e3 * (t1 - t0):.1f} ms, fuse {1e3 * (t2 - t1):.1f} ms, cached {op.library.cached}, "
      f"cuda initialized {torch.cuda.is_initialized()}")
pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
