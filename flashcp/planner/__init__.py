"""The planner: cost model, strategies, Numba kernels, plan files, verification and the CP-SAT audit."""
