"""Runtime: the per-rank loader (plan -> batch + CPAttnMeta), context-parallel attention, and ``CPAttention``
(that attention bound to one batch, what a model attends with).

``flashcp.runtime.kernels`` is the only package that imports ``flash_attn``, lazily, one module per library.
"""

from flashcp.runtime.attention import cp_attention
from flashcp.runtime.comm import CommStats
from flashcp.runtime.meta import COMM_MODES, CPAttnMeta
from flashcp.runtime.module import CPAttention
from flashcp.runtime.recurrent import RecurrentMeta, cp_causal_conv1d, cp_gated_delta_rule, cp_ssd

__all__ = ["COMM_MODES", "CPAttention", "CPAttnMeta", "CPLoader", "CommStats", "RecurrentMeta", "cp_attention",
           "cp_causal_conv1d", "cp_gated_delta_rule", "cp_ssd"]


def __getattr__(name):
    # the loader pulls in pyarrow; import it only when asked for
    if name in ("CPLoader", "Batch"):
        from flashcp.runtime import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'flashcp.runtime' has no attribute '{name}'")
