"""Checks on an HTTP request to ``kvpolicy serve``, made before it reaches mlx-lm's generation thread.

Each check raises :class:`BadRequest` (answered with HTTP 400 and ``{"error": message}``) naming
the header or field and what is accepted. Nothing here imports MLX or mlx-lm.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Optional

# Fields that ask for a per-request method: refused, never silently ignored (see kvpolicy_core.apps.serve).
METHOD_FIELDS = ("kvpolicy", "method")
_READ_CHUNK = 1 << 20  # a claimed body size is read in pieces, never allocated up front

EMPTY_PROMPT = {
    "text": "prompt: no tokens after tokenization; a completion needs at least one prompt token",
    "chat": "messages: the formatted chat has no tokens; a completion needs at least one prompt token",
}


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; the message names the header or field."""


def content_length(value: str) -> int:
    """A ``Content-Length`` header -> its byte count: ASCII digits only (RFC 9110), no sign."""
    digits = value.strip()
    if not (digits.isascii() and digits.isdigit()):
        raise BadRequest(f"Invalid Content-Length header {value!r}: expected the body's size in bytes (digits 0-9)")
    return int(digits)


def read_body(rfile, length: int) -> bytes:
    """Exactly ``length`` bytes of request body from ``rfile``; a body that ends early is refused."""
    chunks, left = [], length
    while left:
        chunk = rfile.read(min(left, _READ_CHUNK))
        if not chunk:
            raise BadRequest(
                f"the request body ended after {length - left} of the {length} bytes "
                "its Content-Length header announced"
            )
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body (UTF-8)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON in request body: {exc}") from None
    except RecursionError:
        raise BadRequest("Invalid JSON in request body: nested too deeply") from None


#: the request's real-valued sampling fields (mlx-lm checks their types and ranges, but NaN passes every range)
FINITE_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "xtc_probability",
    "xtc_threshold",
)
SEED_LIMIT = 1 << 64  # mx.random.seed takes an unsigned 64-bit integer


def check_fields(body: Mapping[str, Any], method: str, chat: bool = False) -> None:
    """Fields of a completion request that mlx-lm would ignore, or fail on inside its generation thread
    (``chat``: a chat completion, whose ``messages`` must be a list of message objects)."""
    if chat and "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            got = type(messages).__name__ if not isinstance(messages, list) else "a list with a non-object item"
            raise BadRequest(
                'messages must be a list of message objects ({"role": ..., "content": ...}), '
                f"got {'a ' if not isinstance(messages, list) else ''}{got}"
            )
    for field in METHOD_FIELDS:
        if field in body:
            raise BadRequest(
                f"{field}: a per-request method is not supported; this server applies its --method "
                f"({method}) to every request. Start another server for another method."
            )
    stop = body.get("stop")
    if not (
        stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("stop must be a string or a list of strings")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")


def check_sampling(values: Mapping[str, Any]) -> None:
    """The sampling fields after mlx-lm's own checks (its types and ranges): each real value finite (NaN passes
    every range check; Infinity is valid JSON to Python), ``seed`` in [0, 2**64) (``mx.random.seed``'s range), every
    ``logit_bias`` value finite."""
    for field in FINITE_FIELDS:
        v = values.get(field)
        if isinstance(v, float) and not math.isfinite(v):
            raise BadRequest(f"{field} must be a finite number (got {v})")
    seed = values.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < SEED_LIMIT):
        raise BadRequest(f"seed must be an integer in [0, 2**64 - 1] (got {seed!r})")
    for token, bias in (values.get("logit_bias") or {}).items():
        if not math.isfinite(bias):
            raise BadRequest(f"logit_bias: the bias of token {token} must be a finite number (got {bias})")


def check_logit_bias(bias: Optional[Mapping[int, float]], vocab_size: Optional[int]) -> None:
    """Every biased token id inside the model's vocabulary (an id past it is an out-of-bounds write)."""
    if not bias or vocab_size is None:
        return
    for token in bias:
        if not 0 <= token < vocab_size:
            raise BadRequest(f"logit_bias: token id {token} is outside the vocabulary (0 to {vocab_size - 1})")


def check_prompt_shape(request) -> None:
    """A text prompt is a string; a chat has at least one message."""
    if request.request_type == "text":
        if not isinstance(request.prompt, str):
            raise BadRequest("prompt must be of type str")
    elif not isinstance(request.messages, list) or not request.messages:
        raise BadRequest("messages must be a non-empty list")
