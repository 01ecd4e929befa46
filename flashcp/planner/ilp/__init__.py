"""CP-SAT (OR-Tools) for the planner: block grids, the all-gather and exact-need receive models, the audit, and
``--effort ilp`` polishing."""
