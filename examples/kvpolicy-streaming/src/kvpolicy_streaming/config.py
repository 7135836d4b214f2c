"""Configs of the two methods: the shared budget fields with method-appropriate defaults."""

from typing import Literal, Optional

from pydantic import Field

from kvpolicy_core import PolicyConfig


class StreamingConfig(PolicyConfig):
    """``method="streamingllm"``: ``budget`` = ``n_sink`` sinks + ``budget - n_sink`` most recent tokens."""

    recent: Optional[int] = Field(0, ge=0, description="Unused by the oldest-first selector; kept at 0.")


class TovaConfig(PolicyConfig):
    """``method="tova"``: scores from the current step's attention only."""

    recent: Optional[int] = Field(0, ge=0, description="Most recent tokens protected (TOVA uses none).")
    signal: Literal["proxy", "observed"] = Field("observed", description="'observed': the model's real last query.")
