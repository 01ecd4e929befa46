"""The strategies' kernels, one module each, and the rules each one follows (the registry that names them is
``flashcp.planner.registry``).

Every strategy maps one packed sequence's document lengths ``doc_lens`` (num_docs,) and a CP size ``cp`` to
a :class:`~flashcp.planner.plan.SequencePlan` whose shards are sorted by (rank, doc, start), never contain
two touching shards of one document on one rank (they are merged), and give every rank its equal-token quota
(``C // N``, the first ``C % N`` ranks one more). The hot loops are the Numba kernels of this package, one module per
strategy; ``tests/naive.py`` re-implements every rule below in plain Python and the tests require identical
plans.

The kernels' arrays, all C-contiguous: ``lens`` (num_docs,) int64, the document lengths of one sequence (each
> 0); a plan, what every kernel returns, is four (num_shards,) int64 arrays ``doc, start, length, rank`` (shard
i holds tokens ``[start[i], start[i] + length[i])`` of document ``doc[i]`` on rank ``rank[i]``); per-rank
arrays (``work``, ``load``, ``tokens``, ``quotas``) are (cp,) int64; ``offsets`` (num_docs + 1,) int64, the
documents' first tokens in the sequence (``offsets_of``). Scalars: ``cp`` the number of ranks, ``chunk`` a
size in tokens, ``target`` and ``limit`` imbalance ratios (max / mean rank workload, float64; ``np.inf``:
none). A ``*_within`` kernel returns no shards (four empty arrays) when its plan misses ``limit``.

``llama3``
    The sequence is cut into 2N consecutive chunks; rank i gets chunks i and 2N-1-i. Chunk i holds
    ``q_i // 2`` tokens and chunk 2N-1-i the other ``q_i - q_i // 2``, so quotas hold for any C.

``perdoc``
    Every document of length d is cut into 2N chunks of ``d // 2N`` tokens; rank i gets chunks i and
    2N-1-i. The ``d % 2N`` remaining tokens of each document are dealt one at a time to ranks in round-robin
    order, with one pointer that starts at rank 0 and runs on across the documents of the sequence; a rank's
    first extra token of a document lengthens its early chunk, a second one its late chunk. Because the
    pointer never resets, the extras of the whole sequence reach rank i exactly ``E // N + [i < E % N]``
    times, which is what the quotas need (``C = 2N * sum(d // 2N) + E``). Documents shorter than 2N simply
    have empty chunks.

``flashcp`` (the paper's Algorithm 1, parameter ``target_imbalance`` R, default 1.05)
    Documents are sorted by decreasing length (ties: lower index). With the first k of them set aside for
    Per-Doc sharding (k = 0, 1, 2, ...), a temporary plan is built and its imbalance checked; the first k
    whose plan is within R (or k = all documents) wins. Choices the paper leaves open:

    - Per-Doc documents are cut with the ``perdoc`` rule above, dealt in document order; their chunks give
      each rank its starting workload and tokens (never more than its quota).
    - "Least-loaded worker" is the rank with the least attention workload so far (ties: lowest rank).
      Each rank keeps its pieces on a stack in the order it received them.
    - Whole-Doc sharding, while a rank holds more tokens than its quota: the rank with the largest excess
      (ties: lowest rank) pops the piece it received last (its shortest whole document, as documents arrive
      longest first) and the head of that piece, ``min(excess, deficit, piece length)`` tokens, moves to
      the under-filled rank with the least workload (ties: lowest rank), onto that rank's stack. A piece
      moved entirely is a whole document changing rank (no communication); otherwise the rank keeping the
      rest needs the moved head's K/V.
    - The imbalance ratio is ``max / mean`` of rank workloads in float64.

``flashcp+`` (improved, parameter ``target_imbalance``, default 1.01)
    Built on Algorithm 1 with five changes, each aimed at communication or balance:

    1. Tail-anchored splitting. Documents whose own workload exceeds the mean rank workload ("heavy") must
       be split. Instead of cutting all of a heavy document into 2N chunks, its tail ``[d - t, d)`` stays on
       one anchor rank (the rank with the least estimated workload) and only its head ``[0, d - t)`` is
       zigzagged. ``t`` is the longest tail the anchor can hold within the mean workload, counting its
       share of the zigzagged heads, and within its token quota. The tail is a document's last shard, so it
       costs nothing in the all-gather and only ``d - t`` tokens are ever sent.
    2. Token-aware greedy: each whole document goes to the least-loaded rank that still has room for it
       under its token quota (the least-loaded rank overall when none has).
    3. Token repair moves whole documents first: while a rank is over quota, it gives away the longest
       whole document that fits both its excess and some under-filled rank's deficit (ties: lower document,
       then the receiver with less workload); only when none fits does it cut a head, from its longest
       whole document (else its longest piece), for the under-filled rank with the least workload.
    4. Levers: for every zigzag document, the boundary between ranks i and i+1's early chunks and the one
       between their late chunks move together by ``delta``. Tokens stay equal on every rank and exactly
       ``delta * gap`` workload moves between the two ranks (``gap`` = distance between the boundaries), so
       a chain of such moves along ranks 0..N-1 balances workload almost exactly at nearly no extra
       communication. Each ``delta`` is rounded to the nearest integer and clamped so every chunk stays
       non-negative (ranges computed backwards from the last rank).
    5. Window swaps, while the busiest rank ``a`` is above the target: for the lightest ranks ``b`` below
       the mean, ``a`` gives the window ``[p, p + t)`` of its longest whole document to ``b`` and takes
       ``b``'s whole document of ``t`` tokens; tokens stay equal and ``p * t`` workload moves. The
       document with the smallest ``max(p, t)`` (the communication it adds) is chosen; at most 4N swaps.

    The first candidate sets aside exactly the heavy documents (tail-anchored). If it misses the target,
    further candidates zigzag the k longest documents whole (k = max(1, heavy), ...) as Algorithm 1 does,
    with changes 2-5; the first within the target wins, else the most balanced one.

``magi`` (MagiAttention's MinHeap dispatch, parameter ``chunk_size``, default 512)
    The sequence is cut into chunks of ``chunk_size`` tokens (the last one shorter); a chunk's workload is
    that of its pieces cut at document bounds. Chunks are taken by decreasing workload (ties: the later
    chunk first, as MagiAttention reverses an ascending stable sort); each goes to the rank with the least
    workload that has room for all of it (ties: lowest rank). When ``C`` is a multiple of ``N *
    chunk_size`` every rank gets exactly ``C / (N chunk_size)`` chunks, which is MagiAttention's rule (at
    most ``ceil(chunks / N)`` per bucket). Otherwise, when no rank has room for a whole chunk, the
    least-loaded rank with room takes the chunk's head that fits and the rest goes on, head first, to the
    least-loaded rank with room; so quotas hold for any C.

``ptrr`` (PyTorch's ``_PTRRLoadBalancer``, parameter ``chunk_size``, default 128 = flex_attention's block)
    Query block i of ``chunk_size`` tokens has process time ``i - floor(s / b) + 1``, the key blocks it reads
    under the document-causal mask (``s`` = start of the document holding its first token). Blocks are
    sorted by decreasing process time (stable: ties keep block order); row k of N blocks is dealt to ranks
    0..N-1 when k is even and N-1..0 when k is odd. When ``C`` is a multiple of ``N * chunk_size`` (what
    torch requires) this is torch's assignment; otherwise a rank without room for its block takes the head
    that fits and the rest goes on to the rank with room and the least process time so far.

``dcp`` (DCP's hypergraph partitioning, SOSP'25; parameter ``chunk_size``, default 512; needs ``mtkahypar``)
    Every document is cut into ``chunk_size``-token blocks from its start; blocks are vertices weighted by
    their workload, and block b's K/V need (b and every later block of its document) is a net weighted by
    its tokens, so the partitioner's connectivity objective is the plan's total exact-need traffic.
    Mt-KaHyPar splits the blocks into N parts (epsilon 0.01, deterministic, one thread); then, as
    Algorithm 1's Whole-Doc step does, the rank most over its quota moves the head of its piece with the
    shortest prefix to the under-filled rank with the least workload until every rank holds its quota
    (``flashcp.planner.strategies.dcp``). Planned in Python; without the package it refuses in one sentence.

``flashcp2`` (parameters ``target_imbalance`` 1.05, ``effort`` 1, ``objective`` "time", ``profile``, shape,
``topology``)
    Per sequence, a portfolio under the step-time objective (``flashcp.costmodel.objective``: the projected
    step time of ``flashcp bench`` for one layer of H = H_kv = 32, D = 128 by default, or every layer of a
    model by its kind, auto comm with local shards overlapping the exchange). ``target_imbalance`` is a
    ceiling, not a goal: inside it the step time, which charges the slowest rank, decides; a candidate above
    it is never taken (only a faster peer's plan, below). The first plan is
    ``flashcp+`` at its own target 1.01 (or the ceiling when lower), its search stopped at 8 zigzagged
    documents (``flashcp_plus.flashcp_plus_bounded``: the same plan whenever ``flashcp+`` needs no more). Then,
    in order: Algorithm 1 (R = 1.05) when it needs at most 8 Per-Doc documents, which replaces the first
    plan when faster (the two set the time to beat: the result is never slower than either of them when
    they meet the ceiling); ``flashcp+`` at the ceiling (when above 1.01, same bound); chunked assignments
    that keep documents contiguous (``flashcp2.affinity_kernel``: every document cut into chunks from its
    end, chunks by decreasing workload to the least-loaded rank with room, except that the rank holding the
    next chunk of the same document takes it while it stays within the mean workload and within
    ``tolerance * mean`` of the least-loaded rank; chunks are fractions of a rank's quota ``q = C // N``:
    (chunk, tolerance) = (q/4, 0.03), (q/8, 0.1), (q/8, 0.01), (q/16, 0.01), (q/8, 0.03), (q/4, 0.01),
    (q/16, 0.03), (q/16, 0.1), i.e. 2048, 1024 and 512 tokens at C = 131072, N = 16), ``magi`` at q/8
    tokens, ``llama3``; effort 2 and more add ``magi`` at q/16 and q/4; effort 0 tries only the first three
    chunked assignments. A candidate with more than ``num_docs + 32 N`` shards (``MAX_EXTRA_SHARDS``) is
    not taken, nor is one slower than ``flashcp+``. When the first plan misses the ceiling, the first
    candidate within it replaces it (if none is as fast, ``flashcp+``'s plan stays: the result is never slower
    than ``flashcp+``); otherwise a candidate not slower than the time to beat replaces the best one when
    it is faster by more than ``RECEIVE_TIE`` (2%) of the best time, or not faster but no less balanced
    and within that share with a lower largest exact-need receive (equal: faster). A candidate whose busiest rank alone
    (``objective.rank_floor``) is too slow to win is skipped unpriced, which changes nothing. Then, with
    ``effort`` > 0, local search: paired moves of two document boundaries between the same two ranks by the
    same shift (1024, 256, 64, 16 tokens) so every rank keeps its quota, kept when the step time drops, the
    imbalance stays within the ceiling (or the chosen plan's own, when above) and the largest receive does
    not grow; passes repeat while one improves, for at most ``16 * effort`` evaluations. Last, the default
    plans of ``flashcp+`` (1.01), ``magi`` (512), ``flashcp`` (1.05), ``llama3`` and ``ptrr`` (128) are
    priced (``flashcp2.PEERS``; each skipped when its busiest rank alone is not faster): the first one faster
    than the plan replaces it, even above the ceiling, so ``flashcp2`` is never slower than any of them under
    its objective (which prices the model's layer kinds, ``objective``). The bounds keep the
    planning time of a sequence to a few candidates and a fixed search budget, whatever the sequence. The
    candidates in their order, with the effort each needs, are the table ``flashcp2.PORTFOLIO``.

    Topology (``topology`` "NODESxGPUS", or the profile's ``gpus_per_node``): rank r is on node
    ``r // GPUS``; the objective prices rows between nodes at the profile's ``inter_node_gbps`` and rows
    inside one at ``link_gbps`` (both links at once: the slower side of the busiest rank decides). Every
    candidate's ranks are then placed on nodes before it is priced (``topology.relabel_kernel``): ranks of
    equal tokens are swapped between nodes while the largest cross-node rows of one rank (then the total
    crossing) drop, which keeps a document's pieces inside one node where the plan allows it; the search
    then prices moves with both links.

    Token slack (``token_slack`` F, default 0, beyond the paper): a rank may hold up to ``floor(F C / N)``
    tokens more or fewer than its quota. The objective then also prices every rank's per-token layers
    (projections and MLP, ``objective.AttentionShape.token_flops``), and each search pass first tries single
    boundary moves that keep both ranks within that window. Plans record ``token_slack`` in plan.json; the
    portfolio's candidates keep exact quotas.
"""
