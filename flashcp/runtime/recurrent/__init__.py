"""Recurrent layers under CP: Gated DeltaNet (Qwen3-Next) and Mamba-2 SSD (Nemotron-H), with their short
causal convolution, run over a plan's pieces of documents.

- ``chunked``: the pure-PyTorch chunked kernels (segments with initial and final states);
- ``backends``: the kernel backends the layers take (``reference``, ``fla``, ``mamba_ssm``, ``auto``), the one
  module that imports those libraries;
- ``meta``: ``RecurrentMeta.from_plan``, each rank's pieces, where their predecessors are and the routes of the
  exchanges;
- ``cp``: the layers across CP ranks (affine state maps, one all-to-all per layer; the scheme and its bytes
  per piece are in its docstring).
"""

from flashcp.runtime.recurrent.chunked import causal_conv1d, chunk_gated_delta_rule, chunk_ssd
from flashcp.runtime.recurrent.cp import cp_causal_conv1d, cp_gated_delta_rule, cp_ssd
from flashcp.runtime.recurrent.meta import RecurrentMeta

__all__ = ["RecurrentMeta", "causal_conv1d", "chunk_gated_delta_rule", "chunk_ssd", "cp_causal_conv1d",
           "cp_gated_delta_rule", "cp_ssd"]
