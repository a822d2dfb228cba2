"""``remat3d bench``: remat3d against what users would pick instead, on the same steps.

>>> from remat3d.bench import SUITES
>>> sorted(SUITES)
['blocks', 'cpu', 'full', 'quick', 'tiny']

Run ``run_suite(get_suite("quick"), "bench-out")``, or ``remat3d bench --suite quick
--out bench-out``; the schema of ``results.json`` is in ``docs/bench.md``.
"""

from remat3d.bench.records import BENCH_SCHEMA, Record, load_results, validate_results
from remat3d.bench.runner import BenchResult, run_suite
from remat3d.bench.suites import SUITES, Case, Suite, get_suite

__all__ = [
    "BENCH_SCHEMA",
    "SUITES",
    "BenchResult",
    "Case",
    "Record",
    "Suite",
    "get_suite",
    "load_results",
    "run_suite",
    "validate_results",
]
