"""The planner: cost model, strategies, Numba kernels, plan files, verification and the CP-SAT audit."""

from flashcp.planner._numba_cache import use_writable_cache

use_writable_cache()
