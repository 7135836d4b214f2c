"""SnapKV (Li et al., 2024, arXiv:2404.14469): one cut at the end of the prompt, by the prompt's last queries.

With the prompt's last ``W`` queries ``q_i`` (the observation window: the question when the prompt ends with
one), G query heads per KV head h, and ``pool_P`` a max-pool over ``P`` neighbouring positions::

    s_{h,j} = pool_P( sum_{g, i in window} softmax_j(q_{g,i} . k_j * scale) )

the cache holds the prompt whole and, when the first decode step arrives, keeps the sinks, the window's ``W``
tokens and the ``budget - n_sink - W`` best-scored others (``when="prompt_end"``). Decode steps after the cut
stream as H2O does (the budget stays an upper bound; SnapKV as published keeps every generated token).
``snapkv:W=w,pool=p`` is ``h2o:when=prompt_end,obs_window=w,pool=p`` bit for bit (tests/test_table.py).
"""

from typing import Literal

from pydantic import Field

from kvpolicy_core import AttentionPolicyConfig, MethodSpec, hookimpl


class SnapKVConfig(AttentionPolicyConfig):
    """``method="snapkv"``: H2O's fields, cut at the end of the prompt; SnapKV's window 32 and pool 7."""

    when: Literal["stream", "prompt_end"] = Field("prompt_end", description="SnapKV cuts at the end of the prompt.")
    signal: Literal["proxy", "observed"] = Field("observed", description="The model's real queries (SnapKV's).")
    obs_window: int = Field(32, ge=0, le=2**31 - 1, description="SnapKV's observation window W.")
    pool: int = Field(7, ge=1, le=255, description="SnapKV's pooling kernel (odd).")


@hookimpl
def register_methods(register):
    register(
        MethodSpec(
            "snapkv",
            SnapKVConfig,
            SnapKVConfig.scorer_name.fget,
            "lowest_score",
            "drop",
            description="SnapKV: cut once at the end of the prompt by the last W queries' pooled attention; drop.",
        )
    )
