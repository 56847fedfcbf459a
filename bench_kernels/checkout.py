"""The repository the benchmarks run from (ROOT), put on sys.path so that a bench script imports the
checkout's dinfer and dinfer_kernels without installing them (both packages sit at the root): every
bench script imports this before them."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
