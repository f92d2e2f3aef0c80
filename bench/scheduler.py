"""`python bench/scheduler.py`: the scheduler benchmark (bench/rank_bench.py).

This file's name is the issue's; as a script, its directory comes first on sys.path, where
this very file would hide the `scheduler` package. So it takes that directory off the path,
loads the interleaving helper by file, and runs the benchmark.
"""

import importlib.util
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
spec = importlib.util.spec_from_file_location("_interleave", os.path.join(HERE, "_interleave.py"))
assert spec is not None
assert spec.loader is not None
helper = importlib.util.module_from_spec(spec)
spec.loader.exec_module(helper)
sys.modules["_interleave"] = helper
runpy.run_path(os.path.join(HERE, "rank_bench.py"), run_name="__main__")
