"""Config fields of the attention-scored methods (H2O, CaM): the signal and the observation window.

``signal``: whose queries score the cache: ``"observed"`` (the model's real queries,
through kvpolicy's attention hook) or ``"proxy"`` (each new key used as the query;
the specification's H2O-adapted, no hook).

``obs_window``/``pool``: a prompt chunk is scored by the attention of its last
``obs_window`` queries, max-pooled over ``pool`` neighbouring positions
(:class:`~kvpolicy_core.parts.observation_window.ObservationWindowScorer`). ``None``
means the signal's default: ``observed`` -> 32 and 15 (chosen on the retrieval task,
docs/methods/h2o.md), ``proxy`` -> 0 (every query) and 1 (no pooling), which is exactly
the specification's cumulative scorer, so ``signal=proxy,recent=0`` is the specification's
reproduction.

``score``: what scores a token. ``"attention"`` (the default) the attention the model pays it (the fields above);
the query-agnostic scorers need no question (docs/methods/query-agnostic.md): ``"keydiff"`` its key's
dissimilarity to the average key (:mod:`~kvpolicy_core.parts.keydiff`, no attention hook) and
``"expected_attention"`` the attention future queries are expected to pay it, from the statistics of the model's
queries (:mod:`~kvpolicy_core.parts.expected_attention`; its options ``n_future``, ``covariance``, ``vnorm``).
``signal`` and ``obs_window`` apply to ``score="attention"`` only; ``pool`` to every score (None: 15 observed and
1 proxy for ``score="attention"``, :data:`POOL_DEFAULTS` for the others).

*Bounds* (refused when the config is made, naming the field): ``pool`` <= :data:`POOL_MAX` (each neighbour is one
op of every compiled decode step: pools far wider make a step take seconds, then crash the compiler);
``n_future`` <= :data:`N_FUTURE_MAX` (the mean rotation holds ``n_future`` angles per rotated pair, for every layer
and prompt chunk: time and memory grow with it, and far larger values crash); the counts ``obs_window`` and
``rescore_every`` <= :data:`MAX_TOKENS` (positions and counters are int32 on the device); ``rope_freqs`` finite.

``rope_freqs``/``rope_traditional``: the layer's RoPE (the angle per position of each rotated pair, and the pair
layout), which ``score="expected_attention"`` needs to move query statistics to future positions.
:meth:`KVCacheBuilder.for_model <kvpolicy_core.integration.builder.KVCacheBuilder.for_model>` fills them for each
layer from the model's attention module (so each layer's cache has its own config); ``None`` means the queries are
not rotated (a model without RoPE).
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Tuple

from pydantic import Field, field_validator, model_validator

from .policy_config import FILLED_BY_BUILDER, PolicyConfig

#: The ``score`` values: the scorer families of the attention-scored methods.
SCORES = ("attention", "keydiff", "expected_attention")
#: ``rescore_every`` when not given, per score: decode steps between full rescorings (0: never at decode).
RESCORE_DEFAULTS = {"keydiff": 8, "expected_attention": 0}
#: Expected Attention's defaults (kvpress's): future positions averaged, covariance term, value-norm rescaling.
EXPECTED_ATTENTION_DEFAULTS = {"n_future": 512, "covariance": True, "vnorm": True}

#: ``pool`` when not given, per query-agnostic score.
POOL_DEFAULTS = {"keydiff": 1, "expected_attention": 1}
#: The widest ``pool``: each neighbour is one maximum in every scoring, so a decode step's cost grows with it (pools
#: far wider make a step take seconds, then crash MLX's compiler).
POOL_MAX = 255
#: The most future positions ``n_future`` may average over: 2**16 angles per rotated pair, held for every layer and
#: prompt chunk (time and memory grow linearly with it; far larger values exhaust memory or crash).
N_FUTURE_MAX = 1 << 16
#: The largest token count a config may give (budgets, windows, intervals): positions and counters are int32.
MAX_TOKENS = 2**31 - 1

#: (obs_window, pool) used when the field is None, per signal (score="attention").
WINDOW_DEFAULTS = {"observed": (32, 15), "proxy": (0, 1)}
#: the observed pool of a prompt cut at its end (``when="prompt_end"``): the question attends to a statement's key
#: words, and the pool must reach past them to the end of the value that follows (a 7-digit answer is 7 tokens,
#: one per digit): the streaming pool of 15 ends before it, 31 covers it
#: (docs/results/long-context-question-in-prompt.md)
CUT_POOL = 31
#: the cut's pool taper (``pool_by_position``): a tie-break only. Each step of distance moves a float32 score by ~8
#: ulps (above its rounding) and 15 steps by 1.5e-5 of it, so plateaus further apart than that keep their order and
#: within one plateau (a statement pooled from one attended token) the nearer tokens rank higher
TIE_TAPER = 1e-6


class AttentionPolicyConfig(PolicyConfig):
    """:class:`PolicyConfig` plus the scorer fields of attention-scored methods."""

    signal: Literal["proxy", "observed"] = Field(
        "observed",
        description="Score signal: 'observed' the model's real queries (attention hook); 'proxy' each new key as the query.",  # noqa: E501
    )
    when: Literal["stream", "prompt_end"] = Field(
        "prompt_end",
        description="When the cache evicts: 'prompt_end' (the default for attention-scored methods) holds the prompt "
        "and cuts it once at its end, with its last queries (the question's) in view, then streams; 'stream' evicts "
        "after every update, so prefill memory stays within budget + one chunk.",
    )
    obs_window: Optional[int] = Field(
        None,
        ge=0,
        le=MAX_TOKENS,
        description="Prompt chunks are scored by their last obs_window queries (0: all; None: 32 observed, 0 proxy).",
    )
    pool: Optional[int] = Field(
        None,
        ge=1,
        le=POOL_MAX,
        description=f"Max-pool width over neighbouring positions for chunk scores (odd, at most {POOL_MAX}; "
        "1: none; None: 31 observed and cut at the prompt's end, 15 observed streaming, "
        "1 proxy, 1 keydiff/expected_attention).",
    )

    score: Literal["attention", "keydiff", "expected_attention"] = Field(
        "attention",
        description="What scores a token: 'attention' the attention it receives; the query-agnostic 'keydiff' "
        "(key dissimilarity to the mean key) and 'expected_attention' (attention expected from future queries).",
    )
    n_future: Optional[int] = Field(
        None,
        ge=1,
        le=N_FUTURE_MAX,
        description="score=expected_attention: future query positions the RoPE rotation is averaged over "
        f"(at most {N_FUTURE_MAX}; None: 512).",
    )
    covariance: Optional[bool] = Field(
        None,
        description="score=expected_attention: include the query covariance term (None: true).",
    )
    vnorm: Optional[bool] = Field(
        None,
        description="score=expected_attention: multiply each expected attention by the token's value norm "
        "(None: true).",
    )
    rescore_every: Optional[int] = Field(
        None,
        ge=0,
        le=MAX_TOKENS,
        description="score=keydiff/expected_attention: rescore every slot at every k-th decode step (prompt chunks "
        "always rescore; between, a new token enters with its row's highest score; 0: never at decode; "
        "None: 8 keydiff, 0 expected_attention).",
    )
    rope_freqs: Optional[Tuple[float, ...]] = Field(
        None,
        description="score=expected_attention: the layer's RoPE angle per position of each rotated pair "
        "(filled per layer by KVCacheBuilder.for_model; None: queries not rotated).",
        json_schema_extra=FILLED_BY_BUILDER,
    )
    rope_traditional: bool = Field(
        False,
        description="score=expected_attention: the RoPE pair layout (true: interleaved pairs; filled by the builder).",
        json_schema_extra=FILLED_BY_BUILDER,
    )

    @field_validator("rope_freqs")
    @classmethod
    def _finite_freqs(cls, value):
        if value is not None and not all(math.isfinite(f) for f in value):
            raise ValueError(f"every RoPE frequency must be a finite number (got {value!r})")
        return value

    @model_validator(mode="after")
    def _odd_pool(self):
        if self.pool is not None and self.pool % 2 == 0:
            raise ValueError(f"pool must be odd (a centred window of neighbours); got pool={self.pool}")
        return self

    @model_validator(mode="after")
    def _fields_of_the_score(self):
        if self.score != "attention":
            given = [
                f"{k}={v}"
                for k, v in (("signal", "proxy"), ("obs_window", self.obs_window))
                if (k == "signal" and self.signal == "proxy") or (k != "signal" and v is not None)
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: signal and obs_window apply to score='attention' "
                    f"(score={self.score!r} reads no attention weights)"
                )
        if self.score == "attention" and self.rescore_every is not None:
            raise ValueError(
                f"rescore_every={self.rescore_every}: applies to score='keydiff' or 'expected_attention' "
                "(score='attention' adds each step's attention)"
            )
        if self.score != "expected_attention":
            given = [k for k in ("n_future", "covariance", "vnorm", "rope_freqs") if getattr(self, k) is not None]
            given += ["rope_traditional"] if self.rope_traditional else []
            if given:
                raise ValueError(
                    f"{', '.join(given)}: apply to score='expected_attention' (got score={self.score!r}); "
                    f"score must be one of {', '.join(repr(s) for s in SCORES)}"
                )
        return self

    @property
    def rescore_interval(self) -> int:
        """Decode steps between full rescorings of the query-agnostic scores (0: never at decode)."""
        return RESCORE_DEFAULTS.get(self.score, 0) if self.rescore_every is None else self.rescore_every

    @property
    def future_positions(self) -> int:
        return EXPECTED_ATTENTION_DEFAULTS["n_future"] if self.n_future is None else self.n_future

    @property
    def uses_covariance(self) -> bool:
        return EXPECTED_ATTENTION_DEFAULTS["covariance"] if self.covariance is None else self.covariance

    @property
    def uses_vnorm(self) -> bool:
        return EXPECTED_ATTENTION_DEFAULTS["vnorm"] if self.vnorm is None else self.vnorm

    @property
    def obs_window_rows(self) -> int:
        return WINDOW_DEFAULTS[self.signal][0] if self.obs_window is None else self.obs_window

    @property
    def pool_width(self) -> int:
        if self.pool is not None:
            return self.pool
        if self.score != "attention":
            return POOL_DEFAULTS[self.score]
        if self.signal == "observed" and self.when == "prompt_end":
            return CUT_POOL
        return WINDOW_DEFAULTS[self.signal][1]

    @property
    def pool_taper(self) -> float:
        """The pool's tie-break (``pool_by_position`` in :mod:`kvpolicy_core.parts.pooling`): at the end-of-prompt cut a
        statement's pooled span is one plateau, and where the budget ends inside it the tokens nearest the attended
        one stay (without it the budget's edge falls anywhere in the plateau and may drop a statement's last digit,
        docs/results/long-context-question-in-prompt.md#ties-inside-a-pooled-span); streaming pools plainly."""
        return TIE_TAPER if self.when == "prompt_end" else 0.0

    @property
    def scorer_name(self) -> str:
        """``keydiff`` or ``expected_attention`` for those scores; for ``score="attention"``:
        ``cumulative_attention`` when every query counts and nothing is pooled, else ``observation_window``."""
        if self.score != "attention":
            return self.score
        if self.obs_window_rows == 0 and self.pool_width == 1:
            return "cumulative_attention"
        return "observation_window"
