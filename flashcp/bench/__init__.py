"""``flashcp bench``: evidence for choosing a CP method, from plan metrics to projected step latency.

Modules, one job each:

- ``profile``: hardware profile files (peak, attention curve, bandwidths, overheads, each with its source);
- ``projection``: per-rank latency of one layer under a plan (attention, comm, copies, overlap, ring);
- ``measure`` / ``calibrate``: timing the real kernels on a device, and a profile from those timings;
- ``systems`` / ``sequences``: the compared systems, planning for them, where sequences come from;
- ``quality``, ``speed``, ``runtime_cpu``, ``latency``: the four scenarios of a plain run; ``ring_cost``: the
  ring baselines by the cost model, run when ``--scenario`` names it;
- ``suite``: the run's configuration and the scenarios in order; ``report`` and ``plots``: its output.
"""
