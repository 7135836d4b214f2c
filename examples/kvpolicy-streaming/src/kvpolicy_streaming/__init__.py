"""kvpolicy-streaming: StreamingLLM and TOVA as kvpolicy methods (an example third-party plugin)."""

__version__ = "0.3.0"
