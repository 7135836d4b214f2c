"""Each layer's RoPE read from an mlx-lm model, for the scorers that move queries between positions.

mlx-lm's attention modules hold their RoPE as ``rope``: ``nn.RoPE`` (``dims``, ``base``, ``scale``,
``traditional``) or a variant with a frequency table ``_freqs`` (llama3, YaRN, longrope, proportional), all
applied through ``mx.fast.rope``. Both are reduced to the angle per position of each rotated pair::

    theta_r = scale * base ** (-2r / dims)        (nn.RoPE)          theta_r = 1 / _freqs_r   (a table)

and checked against the module itself: rotating the module's output at position 0 by ``P·theta`` must give its
output at position P (so a constant scale the module applies, YaRN's mscale or longrope's, is allowed and
cancels). A RoPE whose angles depend on the sequence length (dynamic NTK) or that fails the check is refused.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx

from ..errors import ModelError
from ..parts.expected_attention import rotate_pairs

#: the attention module's attribute names in mlx-lm's model families
ATTENTION_NAMES = ("self_attn", "attention", "attn", "mixer")
#: the position of the check, and its tolerance (relative to the probe's norm; float32 angles at P)
PROBE_POSITION, PROBE_TOLERANCE = 1000, 1e-3


def layer_attention(layer):
    """The attention module of an mlx-lm layer that holds a ``rope``, or None."""
    for name in ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if module is not None and getattr(module, "rope", None) is not None:
            return module
    return None


def rope_freqs(rope) -> Tuple[Tuple[float, ...], bool]:
    """(theta per rotated pair as float32 values, traditional) of an mlx-lm RoPE module (see the module)."""
    name = type(rope).__name__
    if name == "DynamicNTKScalingRoPE":
        raise ModelError(
            f"{name}: its base grows with the sequence length, so no fixed angle per position exists to move "
            "queries to future positions; score=expected_attention cannot serve this model (use score=keydiff)"
        )
    table = getattr(rope, "_freqs", None)
    if isinstance(table, mx.array):
        theta = 1.0 / table.astype(mx.float32)
    elif hasattr(rope, "base") and hasattr(rope, "dims"):
        exponents = mx.arange(0, rope.dims, 2, dtype=mx.float32) / rope.dims
        theta = getattr(rope, "scale", 1.0) * mx.power(mx.array(float(rope.base), dtype=mx.float32), -exponents)
    else:
        raise ModelError(f"{name}: not an mlx-lm RoPE kvpolicy can read (no dims/base, no _freqs)")
    return tuple(float(x) for x in theta.tolist()), bool(getattr(rope, "traditional", False))


def check_rope(rope, freqs: Tuple[float, ...], traditional: bool) -> None:
    """Raise :class:`ModelError` unless rotating ``rope``'s output at 0 by ``P·freqs`` gives its output at P."""
    dims = 2 * len(freqs)
    x = mx.random.normal((1, 1, 1, dims), key=mx.random.key(0))
    at0, atp = rope(x, offset=0), rope(x, offset=PROBE_POSITION)
    angles = PROBE_POSITION * mx.array(freqs, dtype=mx.float32)
    mine = rotate_pairs(at0, mx.cos(angles), mx.sin(angles), traditional)
    err = (mx.abs(mine - atp).max() / mx.sqrt((atp * atp).sum())).item()
    if not err <= PROBE_TOLERANCE:
        raise ModelError(
            f"{type(rope).__name__}: its rotation is not the angle table kvpolicy read from it (relative error "
            f"{err:.2g} at position {PROBE_POSITION}); score=expected_attention cannot serve this model"
        )


def model_ropes(model, n_layers: int) -> list:
    """[(freqs, traditional)] per layer, read from each layer's attention ``rope`` and checked (once per distinct
    RoPE). Raises :class:`ModelError` naming the layer when one cannot be read."""
    layers = model.layers
    out, seen = [], {}
    for i in range(n_layers):
        attn = layer_attention(layers[i]) if i < len(layers) else None
        if attn is None:
            raise ModelError(
                f"layer {i}: its attention has no `rope` module kvpolicy can read; score=expected_attention needs "
                "each layer's RoPE (use score=keydiff, which needs none)"
            )
        try:
            freqs, traditional = rope_freqs(attn.rope)
            key = (type(attn.rope).__name__, freqs, traditional)
            if key not in seen:  # checked once per distinct RoPE
                check_rope(attn.rope, freqs, traditional)
                seen[key] = True
        except ModelError as exc:
            raise ModelError(f"layer {i}: {exc}") from None
        out.append((freqs, traditional))
    return out
