"""Recurrent layers under CP: Gated DeltaNet (Qwen3-Next) and Mamba-2 SSD (Nemotron-H), with their short
causal convolution, run over a plan's pieces of documents.

``chunked``: the pure-PyTorch chunked kernels (segments with initial and final states).
"""

from flashcp.runtime.recurrent.chunked import causal_conv1d, chunk_gated_delta_rule, chunk_ssd

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "chunk_ssd"]
