"""A strategy written outside flashcp, the whole of it: this kernel file and the one registry entry in
tests/planner/test_batch.py. The Ring-Attn layout with the rank order reversed: the packed sequence cut into
N contiguous equal-token chunks, chunk i on rank N - 1 - i, each chunk cut into pieces of at most
``chunk`` tokens (merged again where they touch)."""


from flashcp._numba import njit
from flashcp.costmodel.workload import offsets_of, token_quotas_kernel
from flashcp.planner.strategies.pieces import emit_span, finish_pieces, new_pieces


@njit(cache=False)  # outside flashcp: numba's cache would key it by this file alone
def reversed_ring_kernel(lens, cp, chunk):
    offsets = offsets_of(lens)
    quotas = token_quotas_kernel(offsets[-1], cp)
    capacity = lens.shape[0] + offsets[-1] // chunk + 2 * cp + 2
    pdoc, pstart, plen, prank = new_pieces(capacity)
    count = 0
    doc = 0
    pos = 0
    for i in range(cp):
        end = pos + quotas[i]
        while pos < end:
            step = min(chunk, end - pos)
            doc, count = emit_span(offsets, doc, pos, pos + step, cp - 1 - i, pdoc, pstart, plen, prank, count)
            pos += step
    return finish_pieces(pdoc, pstart, plen, prank, count, lens)
