"""The cost model, flashcp's bottom layer: the single source of truth for workload, quotas, imbalance,
communication volume and step time.

It imports only numpy, numba and flashcp's errors; the planner, the runtime, the audit and the bench import it,
and nothing in it imports them. Modules:

- ``workload``: workload of a shard, equal-token quotas, per-rank sums, imbalance, the token-slack window;
- ``comm``: every exchange volume of a plan in one kernel (``exchange_volumes``: exact-need send and receive,
  their parts across nodes, all-gather contributions), savings, bytes per token, the ``auto`` comm rule, rows
  of the busiest rank inside and across nodes, the ring baseline's traffic;
- ``sort``: the sorting and search helpers the kernels share;
- ``limits``: the longest context and largest CP size flashcp plans;
- ``shape``: ``AttentionShape``, the model a step is priced for;
- ``models``: ``ModelSpec``, a model's shape and per-layer attention kinds, the built-in table, config.json;
- ``profile``: ``HardwareProfile`` and its JSON files (``profiles/``);
- ``curve``: the attention throughput curve (TFLOP/s by sequence length) the profile and the objective read;
- ``objective``: the Numba step-time objective the planner minimises;
- ``projection``: the per-rank and per-step projection ``flashcp bench`` reports, on the same functions.
- ``recurrent``: the recurrent layers' exchange bytes and split pieces' extra work for a plan
  (``RecurrentShape``);
- ``hybrid``: hybrid models' published shapes and the bytes a step exchanges against an all-attention twin.
A plan is described by four parallel integer arrays, one entry per shard:

    shard_doc    document index inside the packed sequence
    shard_start  first token of the shard inside its document (its prefix length)
    shard_len    number of tokens (> 0)
    shard_rank   CP rank that computes the shard

Definitions (docs/DESIGN.md section 2, paper section 3):

- workload of a shard: ``(2*start + length + 1) * length / 2`` query-key pairs of causal attention;
  always an integer.
- equal-token quotas: every rank gets ``C // N`` tokens, the first ``C % N`` ranks one more.
- imbalance ratio: ``max_rank W / mean_rank W``.
- all-gather comm (paper Eq. 5, compacted): a rank contributes every shard of its that is not the last shard
  of its document and whose document has shards on more than one rank; the critical path is the largest
  contribution (an all-gather moves equal-sized buffers).
- exact-need comm: rank r receives, per document, the tokens of ``[0, max end of r's shards)`` it does not
  hold itself; the critical path is the largest receive.
- comm saving: ``1 - critical path / (C / N)``, against the full-KV all-gather of Llama3 / Per-Doc CP.
- exact-need saving: ``1 - max received / ((N - 1) * C / N)``, against the tokens every rank receives in
  that full-KV all-gather (the all-gather saving above is the same ratio, as a rank receives N - 1 buffers).
- K/V bytes per token for one layer and one pass: ``2 * H_kv * D * dtype_bytes``; backward moves dK/dV:
  as much again over ``a2a`` (partials on the wire in the K/V dtype, summed in float32 at the owner), but
  ``max(dtype_bytes, 4)`` bytes per element over the all-gather's reduce-scatter (``allgather``, ``full``),
  which sums inside the collective in float32 (``grad_bytes_per_token``; ``flashcp.runtime.comm``).
- ``auto`` comm: ``a2a`` when its busiest rank moves fewer bytes, forward plus backward, than an
  all-gather rank does (``comm.auto_comm_a2a``).
- ring comm (Ring-Attn baseline): every rank's whole K/V block travels around the ring in ``N - 1`` steps,
  so rank r receives ``C - T_r`` tokens and sends ``C - T_{r+1}`` per pass, whatever the plan. Its attention
  runs as one kernel call per step over the visiting block (``ring_step_work``).
"""
