"""The ``kvpolicy`` command line: methods, generate, cache-prompt, eval, convert, serve.

Loads the optimised BLAS before mlx on Linux and runs models in fp32 there. Errors
are one line (``kvpolicy: error: ...``, exit 2); ``KVPOLICY_DEBUG=1`` shows tracebacks. Long steps (a prefill of
at least 512 tokens, KVzip's reconstruction, the suite's rows) report their progress on stderr
(:mod:`.progress`: one line rewritten in place on a terminal, one line per step elsewhere; ``--no-progress``
silences it where the command has that option).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, List, Optional

DEFAULT_COMPARISON = ["full", "rotating", "h2o", "cam"]


class CLIError(Exception):
    """A user error: printed as one line."""


# ----------------------------------------------------------------------------- helpers
def _config_from_file(path: str) -> Any:
    from .textfile import read_text_file

    text = read_text_file(path, "--config")
    if Path(path).suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise CLIError("TOML configs need Python >= 3.11; use JSON") from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise CLIError(f"--config {path}: invalid TOML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CLIError(f"--config {path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None


def _print_generation(model, tokenizer, prompt, caches, args):
    """Stream ``args.max_tokens`` tokens of ``prompt`` (text or ids) through ``caches`` to stdout, prefill progress
    on stderr; returns mlx-lm's last response (its counts and speeds)."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from ..runtime.progress import reporter

    last = None
    for response in mlx_lm.stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        sampler=make_sampler(temp=args.temp),
        prompt_cache=caches,
        prompt_progress_callback=reporter("prefill"),
    ):
        print(response.text, end="", flush=True)
        last = response
    print()
    return last


def _with_budget(spec: Any, budget: Optional[int]) -> Any:
    from ..eval.perplexity import parse_spec

    kind, value = parse_spec(spec)
    if budget is None or kind == "full":
        return spec if kind != "policy" else value
    if kind == "rotating":
        return f"rotating:budget={budget}"
    from ..config.parse import parse_config

    if kind == "compress-once":
        from ..integration.compress_once import CompressOnceSpec

        return CompressOnceSpec(value.scorer, parse_config(value.config, budget=budget))
    return parse_config(value, budget=budget)


def _with_storage(spec: Any, args) -> Any:
    """``spec`` with ``--kv-bits``/``--kv-group-size`` (its kept rows stored quantized) where it is a policy;
    other caches (``full``, ``rotating``) are left as they are."""
    from ..eval.perplexity import parse_spec

    bits = getattr(args, "kv_bits", None)
    kind, value = parse_spec(spec)
    if bits is None or kind != "policy":
        return spec
    from ..config.parse import parse_config

    return parse_config(value, kv_bits=bits, kv_group_size=args.kv_group_size)


def _with_memory(spec: Any, kv_memory: Optional[str]) -> Any:
    """``spec`` with ``kv_memory`` (bytes for the kept cache: the builder picks the budget) where it is a policy."""
    from ..eval.perplexity import parse_spec

    kind, value = parse_spec(spec)
    if kv_memory is None:
        return spec if kind != "policy" else value
    if kind != "policy":
        raise CLIError(f"--kv-memory: {spec_label_of(spec)} is not a kvpolicy method; give it a budget instead")
    from ..config.parse import parse_config

    return parse_config(value, kv_memory=kv_memory)


def spec_label_of(spec: Any) -> str:
    from ..eval.perplexity import spec_label

    return spec_label(spec)


def _load_model(path_arg: Optional[str], dtype: str, parallel: str = "auto"):
    import mlx.core as mx
    import mlx_lm

    from ..model.resolve import resolve_model_path
    from ..runtime.distributed import describe, load_sharded, world

    want = "float32" if dtype == "auto" else dtype
    path = resolve_model_path(path_arg, "float32" if path_arg is None and want == "float32" else want)
    size = world()[1]
    if size > 1:  # under mlx.launch: split the model with mlx-lm's sharded_load
        model, tokenizer, mode = load_sharded(path, parallel)
        mx.random.seed(0)  # every rank must sample the same tokens
        print(f"kvpolicy: {describe(model, mode, size)}", file=sys.stderr)
    else:
        model, tokenizer = mlx_lm.load(str(path))
    if dtype == "auto" and sys.platform.startswith("linux"):
        model.set_dtype(mx.float32)
    elif dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer, path


def _world():
    """(rank, size) under mlx.launch; (0, 1) in one process."""
    from ..runtime.distributed import world

    return world()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# ----------------------------------------------------------------------------- commands
def _field_row(field, default) -> dict:
    from ..config.policy_config import filled_by_builder

    if field.is_required():
        return {"default": None, "required": True, "description": field.description or "", "filled_by_builder": False}
    return {"default": default, "description": field.description or "", "filled_by_builder": filled_by_builder(field)}


def _field_line(name: str, f: dict) -> str:
    default = "" if f.get("required") else f" = {f['default']!r}"
    return f"    {name}{default}  {f['description']}"


def cmd_methods(args) -> int:
    """The common fields once (KVCacheConfig's and PolicyConfig's, with PolicyConfig's own defaults), then each
    method with its parts and only its own fields; under a method, the common fields whose default it changes and
    those its parts never read. Fields the builder fills from the model (``rope_freqs``) are in ``--json`` only."""
    from ..config.cache_config import KVCacheConfig
    from ..config.policy_config import COMMON_FIELDS, PolicyConfig
    from ..plugin.discovery import get_registry

    reg = get_registry()
    base = PolicyConfig.model_fields
    kv_fields = KVCacheConfig.model_fields
    common = {
        "KVCacheConfig": {n: _field_row(kv_fields[n], kv_fields[n].get_default()) for n in COMMON_FIELDS},
        "PolicyConfig": {n: _field_row(field, field.get_default()) for n, field in base.items()},
    }
    rows = []
    for name, entry in sorted(reg.methods().items()):
        spec = entry.obj
        config = spec.config_class()
        own, changed = {}, {}
        for fname, field in spec.config_class.model_fields.items():
            if fname not in base:
                own[fname] = _field_row(field, getattr(config, fname))
            elif getattr(config, fname) != base[fname].get_default():
                changed[fname] = getattr(config, fname)
        rows.append(
            {
                "method": name,
                "package": entry.dist or entry.plugin,
                "version": entry.version,
                "parts": spec.part_names(config),
                "description": spec.description,
                "fields": own,
                "common_defaults_changed": changed,
                "common_not_used": [f for f in base if f in spec.ignores],
            }
        )
    if args.json:
        out = {"common_fields": common, "methods": rows, "failures": reg.failures}
        print(json.dumps(out, indent=2, default=str))
        return 0
    print("common to every method (KVCacheConfig):")
    for fname, f in common["KVCacheConfig"].items():
        print(_field_line(fname, f))
    print("common to every method (PolicyConfig; a method may change a default, shown under it):")
    for fname, f in common["PolicyConfig"].items():
        if not f["filled_by_builder"]:
            print(_field_line(fname, f))
    shared = _shared_field_blocks(reg.methods(), base)
    for cls_name, (users, fields) in shared.items():
        print(f"common to {', '.join(users)} ({cls_name}; a method may change a default, shown under it):")
        for fname, f in fields.items():
            if not f["filled_by_builder"]:
                print(_field_line(fname, f))
    for r in rows:
        parts = ", ".join(f"{k}={v}" for k, v in r["parts"].items())
        print(f"{r['method']}  ({r['package']} {r['version'] or ''})".rstrip())
        if r["description"]:
            print(f"  {r['description']}")
        print(f"  parts: {parts}")
        if r["common_defaults_changed"]:
            changed = ", ".join(f"{k}={v!r}" for k, v in r["common_defaults_changed"].items())
            print(f"  common defaults changed: {changed}")
        if r["common_not_used"]:
            print(f"  common fields not used by this method: {', '.join(r['common_not_used'])}")
        block = next(((c, fields) for c, (users, fields) in shared.items() if r["method"] in users), None)
        if block is not None:
            moved = {f: v["default"] for f, v in r["fields"].items() if f in block[1] and v != block[1][f]}
            if moved:
                print(f"  {block[0]} defaults changed: {', '.join(f'{k}={v!r}' for k, v in moved.items())}")
        items = [
            (f, v)
            for f, v in r["fields"].items()
            if not v["filled_by_builder"] and (block is None or f not in block[1])
        ]
        if items:
            print(f"  fields{f' (besides {block[0]} above)' if block else ''}:")
        for fname, f in items:
            print(_field_line(fname, f))
    for failure in reg.failures:
        print(f"warning: {failure}", file=sys.stderr)
    print("baselines (kvpolicy eval/generate): full, rotating:budget=N (mlx-lm RotatingKVCache, keep=4)")
    return 0


def _shared_field_blocks(methods: dict, base: dict) -> dict:
    """{config class name: (methods, fields)} for the config classes between :class:`PolicyConfig` and a method's
    own that two or more methods share (the attention-scored methods' ``AttentionConfig``): their fields print
    once, with the class's own defaults."""
    users: dict = {}
    for name, entry in sorted(methods.items()):
        parent = entry.obj.config_class.__mro__[1]
        if parent.__name__ != "PolicyConfig" and hasattr(parent, "model_fields"):
            users.setdefault(parent, []).append(name)
    blocks = {}
    for parent, names in users.items():
        if len(names) > 1:
            fields = {
                f: _field_row(field, field.get_default())
                for f, field in parent.model_fields.items()
                if f not in base and not field.is_required()
            }
            blocks[parent.__name__] = (names, fields)
    return blocks


def _read_prompt(args) -> str:
    if args.file:
        from .textfile import read_text_file

        return read_text_file(args.file, "--file")
    if args.prompt and args.prompt != "-":
        return args.prompt
    if args.prompt == "-" or not sys.stdin.isatty():
        text = sys.stdin.read()
        if text.strip():
            return text
    raise CLIError("no prompt: give it as an argument, with --file, or on stdin")


def _check_cache_file(path: Optional[str], option: str) -> None:
    """A ``.safetensors`` file the command will write, checked before the model loads: the suffix, a regular file
    or none (never a device, pipe or directory, nor a symlink to one), its directory present and writable."""
    if path is None:
        return
    from ..runtime.files import check_writable

    if Path(path).suffix != ".safetensors":
        raise CLIError(f"{option} {path}: must end in .safetensors")
    check_writable(path, f"{option} {path}", CLIError)


def _spec_from_args(args) -> Any:
    if args.config and args.method:
        raise CLIError("give either --method or --config, not both")
    return _config_from_file(args.config) if args.config else (args.method or "cam")


def cmd_generate(args) -> int:

    from ..eval.perplexity import kv_bytes, make_caches, spec_label

    _check_cache_file(args.save_caches, "--save-caches")  # before the generation, not after it
    if args.prompt_cache:
        return _generate_from_prompt_cache(args)
    if args.kv_memory is not None and args.budget is not None:
        raise CLIError("give --budget or --kv-memory, not both")
    spec = _with_storage(_with_memory(_with_budget(_spec_from_args(args), args.budget), args.kv_memory), args)
    prompt = _read_prompt(args)
    model, tokenizer, _ = _load_model(args.model, args.dtype, args.parallel)
    caches = make_caches(model, spec)
    if args.kv_memory is not None:
        budgets = [c.budget for c in caches if hasattr(c, "budget")]
        print(
            f"[kv-memory {args.kv_memory}: budget {round(sum(budgets) / len(budgets))} tokens per layer on average "
            f"({min(budgets)}-{max(budgets)})]",
            file=sys.stderr,
        )
    last = _print_generation(model, tokenizer, prompt, caches, args)
    kept, full = kv_bytes(caches)
    import mlx.core as mx

    summary = {
        "method": spec_label(spec),
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tokens": last.generation_tokens,
        "generation_tps": round(last.generation_tps, 2),
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
        "compression_ratio": round(full / kept, 3) if kept else 1.0,
        "peak_memory_gb": round(last.peak_memory, 3),
        "active_memory_bytes": int(mx.get_active_memory()),  # measured by MLX's allocator, model included
        "blas": _blas_summary(),
    }
    size = _world()[1]
    if size > 1:
        summary["world_size"] = size  # KV bytes above: rank 0's share
    if args.save_caches:
        from ..integration.persistence import save_caches

        summary["caches_file"] = str(save_caches(args.save_caches, caches))
    if args.json:
        print(json.dumps(summary), file=sys.stderr)
    else:
        print(
            f"[{summary['method']}] prompt: {summary['prompt_tokens']} tok, {summary['prompt_tps']} tok/s | "
            f"generation: {summary['generation_tokens']} tok, {summary['generation_tps']} tok/s | "
            f"KV kept {_human(kept)} of {_human(full)} (x{summary['compression_ratio']}) | "
            f"peak memory {summary['peak_memory_gb']} GB"
            + (f" | rank 0 of {size}: KV bytes are its share" if size > 1 else ""),
            file=sys.stderr,
        )
    return 0


def _generate_from_prompt_cache(args) -> int:
    """``kvpolicy generate --prompt-cache FILE QUESTION``: answer from a copy of a compressed document's caches."""

    from ..eval.perplexity import kv_bytes
    from ..model.resolve import resolve_model_path
    from .prompt_file import file_metadata, load_prompt_file, question_ids

    if args.method or args.config or args.budget is not None or args.kv_memory is not None:
        raise CLIError(
            "--prompt-cache: the method comes from the file; drop --method, --config, --budget and --kv-memory"
        )
    if _world()[1] > 1:
        raise CLIError("--prompt-cache runs in one process (not under mlx.launch)")
    metadata, info = file_metadata(args.prompt_cache)
    if "model" not in metadata:
        raise CLIError(f"--prompt-cache {args.prompt_cache}: the file does not record its model")
    saved_model = Path(metadata["model"])
    if args.model is not None and resolve_model_path(args.model).resolve() != saved_model.resolve():
        raise CLIError(f"--model {args.model} is not the model the prompt cache was made with ({saved_model})")
    dtype = info["dtype"] if args.dtype == "auto" and info and info.get("dtype") else args.dtype
    model, tokenizer, _ = _load_model(str(saved_model), dtype, args.parallel)
    caches, _, info = load_prompt_file(args.prompt_cache, model)
    ids = question_ids(tokenizer, _read_prompt(args))
    if not ids:
        raise CLIError("the question has no tokens")
    last = _print_generation(model, tokenizer, ids, caches, args)
    kept, full = kv_bytes(caches)
    summary = {
        "method": info["method"] if info else "mlx-lm caches",
        "prompt_cache": str(args.prompt_cache),
        "document_tokens": info["tokens_seen"] if info else None,
        "prompt_tokens": last.prompt_tokens,
        "generation_tokens": last.generation_tokens,
        "generation_tps": round(last.generation_tps, 2),
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
        "compression_ratio": round(full / kept, 3) if kept else 1.0,
    }
    if args.save_caches:  # the document and this question's turn, as after any generation (the file is unchanged)
        from ..integration.persistence import save_caches

        summary["caches_file"] = str(save_caches(args.save_caches, caches))
    if args.json:
        print(json.dumps(summary), file=sys.stderr)
    else:
        print(
            f"[{summary['method']} from {summary['prompt_cache']}] document: {summary['document_tokens']} tok | "
            f"question: {summary['prompt_tokens']} tok | generation: {summary['generation_tokens']} tok, "
            f"{summary['generation_tps']} tok/s | KV kept {_human(kept)} of {_human(full)} "
            f"(x{summary['compression_ratio']})",
            file=sys.stderr,
        )
    return 0


def cmd_cache_prompt(args) -> int:
    """``kvpolicy cache-prompt``: compress a long document once into a prompt-cache file (compress once, ask many)."""
    from .prompt_file import cache_prompt

    if _world()[1] > 1:
        raise CLIError("cache-prompt runs in one process (not under mlx.launch)")
    _check_cache_file(args.prompt_cache_file, "--prompt-cache-file")
    spec = _with_budget(_spec_from_args(args), args.budget)
    compress_once = args.compress_once
    if compress_once is None:  # the default: kvzip, unless the method names its own compress-once scorer
        from ..integration.compress_once import split_spec

        compress_once = None if split_spec(spec) is not None else "kvzip"
    text = _read_prompt(args)
    model, tokenizer, path = _load_model(args.model, args.dtype, args.parallel)
    summary = cache_prompt(
        model,
        tokenizer,
        text,
        spec,
        args.prompt_cache_file,
        model_path=str(Path(path).resolve()),
        prefill_step_size=args.prefill_step_size,
        compress_once=compress_once,  # "stream" too: cache_prompt refuses it with a kvzip+METHOD method
    )
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"[{summary['compress_once'] + '+' if summary['compress_once'] else ''}"
            f"{summary['method']}:budget={summary['budget']}] {summary['tokens_seen']} tokens seen, "
            f"{summary['tokens_kept']} kept per layer on average, {summary['max_tokens_kept']} in the largest "
            f"(KV x{summary['compression_ratio']}) -> "
            f"{summary['prompt_cache_file']}"
        )
    return 0


def _add_cache_prompt_parser(sub, model_args) -> None:
    c = sub.add_parser(
        "cache-prompt",
        help="compress a long document once into a prompt-cache file; ask it "
        "questions with generate --prompt-cache, serve --prompt-cache or mlx-lm",
    )
    c.add_argument("prompt", nargs="?", help="the document text ('-' or omitted: stdin)")
    c.add_argument("--file", help="read the document from a file")
    c.add_argument(
        "--prompt-cache-file",
        required=True,
        metavar="FILE.safetensors",
        help="the prompt-cache file to write (mlx-lm's format)",
    )
    c.add_argument("--method", help='config string, e.g. "cam:budget=512" (default: cam)')
    c.add_argument("--config", help="JSON or TOML file with the config")
    c.add_argument("--budget", type=int, help="override the budget")
    c.add_argument(
        "--prefill-step-size", type=int, default=2048, help="tokens per prefill chunk, as mlx-lm's (default 2048)"
    )
    c.add_argument(
        "--compress-once",
        choices=["kvzip", "kvzip-layerwise", "stream"],
        help="how the document is compressed (default kvzip): kvzip scores the whole document by reconstruction "
        "and cuts it at once, sharing layers x budget tokens out over the layers by one ranking; kvzip-layerwise "
        "keeps budget in every layer; stream runs the method's own eviction chunk by chunk, holding no more than "
        "budget + one chunk, where kvzip holds the whole document's K/V until the cut "
        "(docs/methods/compress-once.md)",
    )
    c.add_argument("--json", action="store_true", help="print the summary as JSON")
    model_args(c)
    c.set_defaults(func=cmd_cache_prompt)


def format_table(results: List[dict]) -> str:
    base = next((r for r in results if r["spec"] == "full"), None)
    header = f"{'method':44} {'ppl':>9} {'Δppl':>8} {'tok/s':>7} {'KV kept':>11} {'KV full':>11} {'x':>6}"
    lines = [header, "-" * len(header)]
    for r in results:
        delta = "" if base is None else f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.1f}%"
        ratio = r["kv_bytes_full"] / r["kv_bytes_kept"] if r["kv_bytes_kept"] else 1.0
        lines.append(
            f"{r['spec'][:44]:44} {r['perplexity']:9.3f} {delta:>8} {r['tokens_per_s']:7.1f} "
            f"{_human(r['kv_bytes_kept']):>11} {_human(r['kv_bytes_full']):>11} {ratio:6.1f}"
        )
    return "\n".join(lines)


def storage_args(p) -> None:
    """``--kv-bits`` and ``--kv-group-size``: the policy caches store their kept rows quantized."""
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=[2, 3, 4, 5, 6, 8],
        help="store the kept keys and values quantized to this many bits (as mlx-lm's QuantizedKVCache), under the "
        "method's eviction",
    )
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64, help="with --kv-bits (default 64)")


def cmd_eval(args) -> int:
    from ..eval.perplexity import perplexity, spec_label
    from ..model.corpus import load_corpus

    specs: List[Any] = []
    if args.config:
        specs.append(_config_from_file(args.config))
    specs.extend(args.method or [])
    if not specs:
        specs = list(DEFAULT_COMPARISON)
    specs = [_with_storage(s, args) for s in specs]  # --kv-bits: every policy stores its rows quantized
    if args.task == "ruler":  # the long-context suite: budgets follow each length (--ratio)
        from ..eval.tasks.ruler_cli import cli_run as ruler_run
        from ..runtime.progress import quiet

        with quiet(args.no_progress):  # the rows' prefill and reconstruction lines too
            return ruler_run(args, specs, _with_budget, _load_model)
    budgets = args.budget or [None]
    runs: List[Any] = []
    for spec in specs:
        for b in budgets:
            item = _with_budget(spec, b)
            if spec_label(item) not in [spec_label(r) for r in runs]:
                runs.append(item)
    if args.task != "perplexity":
        from ..eval.tasks.needle import cli_run
        from ..runtime.progress import quiet

        with quiet(args.no_progress):
            return cli_run(args, runs, _load_model)
    try:
        text = load_corpus(args.file)
    except FileNotFoundError as exc:
        raise CLIError(str(exc)) from None
    model, tokenizer, path = _load_model(args.model, args.dtype, args.parallel)
    ids = tokenizer.encode(text)[: args.tokens]
    if len(ids) < 2:
        raise CLIError("the text has fewer than 2 tokens")
    results = []
    for i, spec in enumerate(runs, 1):
        label = spec_label(spec)
        r = perplexity(
            model, ids, spec, chunk=args.chunk, progress=not args.no_progress, desc=f"[{i}/{len(runs)}] {label}"
        )
        results.append(r)
        if not args.no_progress:
            print(
                f"[{i}/{len(runs)}] {label}: ppl {r['perplexity']:.3f}, {r['tokens_per_s']:.1f} tok/s", file=sys.stderr
            )
    print(f"model: {path} | tokens: {len(ids)} | chunk: {args.chunk}")
    print(format_table(results))
    if args.json:
        payload = {
            "model": str(path),
            "tokens": len(ids),
            "chunk": args.chunk,
            "blas": _blas_summary(),
            "results": [{k: v for k, v in r.items() if k != "nll"} | {"nll": r["nll"].tolist()} for r in results],
        }
        if args.json == "-":
            print(json.dumps(payload))
        elif _world()[0] == 0:
            from ..eval.tasks.cli_options import write_json

            write_json(payload, args.json)  # atomically: a failed write leaves the previous file whole
    return 0


def _blas_summary() -> dict:
    from ..runtime.blas import blas_info

    info = blas_info()
    return {k: info.get(k) for k in ("path", "source", "config", "corename", "coretype_forced", "threads")}


def cmd_doctor(args) -> int:
    """What this machine gives MLX: the BLAS chosen (and why others were not), CPU, speed."""
    import platform

    import mlx.core as mx

    from ..runtime.blas import blas_info
    from ..runtime.blas_check import cpu_flags, cpu_model

    info = blas_info(measure=not args.no_measure)
    flags = cpu_flags()
    isa = [
        f
        for f in ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")
        if f in flags
    ]
    report = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "isa": isa,
        "mlx": mx.__version__,
        "blas": info,
    }
    if args.json:
        print(json.dumps(report, indent=1, default=str))
        return 0
    print(f"CPU      {report['cpu']} ({report['cpu_count']} cores; {' '.join(isa) or 'no SIMD flags read'})")
    print(f"MLX      {report['mlx']} on Python {report['python']} ({report['machine']})")
    if info.get("path"):
        forced = (
            f", OPENBLAS_CORETYPE={info['coretype_forced']} (the library's own pick was generic)"
            if info.get("coretype_forced")
            else ""
        )
        print(
            f"BLAS     {info['path']} ({info.get('source')}; {info.get('config') or 'no build string'}; "
            f"core {info.get('corename') or '?'}; threads {info.get('threads') or '?'}{forced})"
        )
    else:
        print(f"BLAS     MLX's reference BLAS: {info.get('reason', 'none loaded')}")
    for s in info.get("skipped", []):
        print(f"skipped  {s['path']} ({s['source']}): {s['reason']}")
    if "mlx_matmul_gflops" in info:
        print(f"speed    fp32 matmul 1024^3: {info['mlx_matmul_gflops']:.1f} GFLOP/s")
    return 0


def cmd_convert(args) -> int:
    from ..model.default import ensure_default_model

    if args.gguf:
        from ..model.gguf_convert import convert

        if not args.out:
            raise CLIError("--out is required with --gguf")
        print(convert(args.gguf, args.out, dtype=args.dtype))
    else:
        print(ensure_default_model(args.dtype))
    return 0


# ----------------------------------------------------------------------------- parser
_RETRIEVAL = ("needle", "needle-multikey")
#: eval's options that only some tasks read (option -> those tasks): given to another task they would be ignored
TASK_OPTIONS = {
    **dict.fromkeys(("--tokens", "--chunk", "--file"), ("perplexity",)),
    "--depths": _RETRIEVAL,
    "--keys": ("needle-multikey",),
    **dict.fromkeys(("--lengths", "--seeds", "--haystack", "--prefill-step"), (*_RETRIEVAL, "ruler")),
    **dict.fromkeys(
        ("--ruler-tasks", "--protocol", "--ratio", "--preset", "--chat", "--export-jsonl", "--from-jsonl"), ("ruler",)
    ),
}


def _given(parser: argparse.ArgumentParser, argv: List[str]) -> List[str]:
    """The options of ``argv``'s subcommand written on the command line (not left at their defaults), as their
    first option string (``--preset``): ``argv`` parsed again with every default suppressed."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    saved = [(a, a.default) for a in sub._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        written = vars(sub.parse_args(argv[1:]))
    finally:
        for a, default in saved:
            a.default = default
    return [a.option_strings[0] for a, _ in saved if a.option_strings and a.dest in written]


def _check_given(args, given: List[str]) -> None:
    """Options that would be silently ignored are refused (CLIError naming them): an eval option another task
    reads (``--preset`` with perplexity), and ``--parallel`` in a single process (it splits a model over the ranks
    of ``mlx.launch``)."""
    if args.command == "eval":
        for option in given:
            tasks = TASK_OPTIONS.get(option)
            if tasks is not None and args.task not in tasks:
                raise CLIError(
                    f"{option} is an option of --task {' and '.join(tasks)}; --task {args.task} does not read it: "
                    "drop it, or choose that task"
                )
    if "--parallel" in given and _world()[1] == 1:
        raise CLIError(
            f"--parallel {args.parallel}: splits the model over the processes of mlx.launch, and this is one process; "
            "run it under mlx.launch (e.g. mlx.launch -n 2 -- kvpolicy ...), or drop --parallel"
        )


def _check_numbers(args) -> None:
    """The numeric options within what the model and machine can do, before anything loads (CLIError naming the
    option). The tasks' own options (``--lengths``, ``--seeds``, ...) are checked by the tasks
    (:mod:`~kvpolicy_core.eval.tasks.cli_options`); budgets by the config."""
    from ..eval.tasks.cli_options import MAX_LENGTH

    chunk = getattr(args, "chunk", None)
    if chunk is not None and chunk < 1:
        raise CLIError("--chunk must be >= 1")
    for attr, option, low in (("chunk", "--chunk", 1), ("tokens", "--tokens", 2), ("max_tokens", "--max-tokens", 1),
                              ("prefill_step_size", "--prefill-step-size", 1)):  # fmt: skip
        value = getattr(args, attr, None)
        if value is not None and not low <= value <= MAX_LENGTH:
            raise CLIError(f"{option} must be in [{low}, {MAX_LENGTH}] (got {value})")
    temp = getattr(args, "temp", None)
    if temp is not None and not (math.isfinite(temp) and temp >= 0):
        raise CLIError(f"--temp must be a finite number >= 0 (0: greedy) (got {temp})")
    if isinstance(getattr(args, "json", None), str) and getattr(args, "task", None) == "perplexity":
        from ..eval.tasks.cli_options import check_output

        check_output(args.json, "--json")  # before the run, not after it


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpolicy", description="KV-cache eviction policies for mlx-lm.")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("methods", help="list installed methods, their parts and config fields")
    m.add_argument("--json", action="store_true", help="machine-readable output")
    m.set_defaults(func=cmd_methods)

    def model_args(sp):
        sp.add_argument(
            "--model", help="local mlx-lm model directory, or 'smollm2' (default: the embedded Gemma 3 270M)"
        )
        sp.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", "float32", "float16", "bfloat16"],
            help="model dtype (auto: float32 on Linux CPU)",
        )
        sp.add_argument(
            "--parallel",
            default="auto",
            choices=["auto", "tensor", "pipeline"],
            help="under mlx.launch: how to split the model (auto: tensor if the model supports it)",
        )

    g = sub.add_parser("generate", help="generate text with a bounded cache")
    g.add_argument("prompt", nargs="?", help="the prompt ('-' or omitted: stdin)")
    g.add_argument("--file", help="read the prompt from a file")
    g.add_argument("--method", help='config string, e.g. "cam:budget=128,merge=mean" (default: cam)')
    g.add_argument("--config", help="JSON or TOML file with the config")
    g.add_argument("--budget", type=int, help="override the budget")
    g.add_argument(
        "--kv-memory",
        metavar="SIZE",
        help="bytes the kept cache may take (512MB, 2GB, 1.5GiB): the largest budget that fits on the model",
    )
    storage_args(g)
    g.add_argument("--max-tokens", type=int, default=100)
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--json", action="store_true", help="print the summary as JSON (stderr)")
    g.add_argument(
        "--save-caches",
        metavar="FILE.safetensors",
        help="save the caches after generating (under mlx.launch: one file per rank; with --prompt-cache: the "
        "document's caches with the question and answer added, the prompt-cache file unchanged)",
    )
    g.add_argument(
        "--prompt-cache",
        metavar="FILE.safetensors",
        help="answer the prompt as a question after the document in this file (kvpolicy cache-prompt); "
        "the method and model come from the file, which is not changed",
    )
    model_args(g)
    g.set_defaults(func=cmd_generate)
    _add_cache_prompt_parser(sub, model_args)

    e = sub.add_parser("eval", help="perplexity (token by token) or retrieval (--task needle) with bounded caches")
    e.add_argument(
        "--task",
        default="perplexity",
        choices=["perplexity", "needle", "needle-multikey", "ruler"],
        help="perplexity (default), needle-in-a-haystack retrieval, or ruler (the long-context suite)",
    )
    e.add_argument(
        "--method",
        action="append",
        help="cache spec (repeatable): a config string, 'full' or 'rotating:budget=N' "
        f"(default: {' '.join(DEFAULT_COMPARISON)})",
    )
    e.add_argument("--config", help="JSON or TOML file with one more config")
    e.add_argument("--budget", type=int, action="append", help="budget(s) applied to every bounded method")
    storage_args(e)
    e.add_argument("--tokens", type=int, default=512, help="tokens of text to evaluate (default 512)")
    e.add_argument("--chunk", type=int, default=1, help="tokens fed per step (1: the StreamingLLM recipe)")
    e.add_argument("--file", action="append", help="text file(s) to evaluate (default: pydoc topics)")
    e.add_argument("--json", help="write results (with per-token NLL) to this file, '-' for stdout")
    e.add_argument("--no-progress", action="store_true")
    from ..eval.tasks import add_needle_arguments

    add_needle_arguments(e)
    from ..eval.tasks.ruler_cli import add_ruler_arguments

    add_ruler_arguments(e)
    model_args(e)
    e.set_defaults(func=cmd_eval)

    d = sub.add_parser("doctor", help="which BLAS MLX uses here (and why), the CPU, measured matmul speed")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--no-measure", action="store_true", help="skip the matmul measurement")
    d.set_defaults(func=cmd_doctor)

    c = sub.add_parser("convert", help="convert the embedded default model (or a Gemma 3 GGUF) once")
    c.add_argument("--gguf", help="a Gemma 3 GGUF file to convert instead of the default model")
    c.add_argument("--out", help="output directory (with --gguf)")
    c.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    c.set_defaults(func=cmd_convert)

    sub.add_parser(
        "serve", add_help=False, help="mlx-lm's OpenAI-compatible server with policy caches (kvpolicy serve --help)"
    )
    return p


def main(argv: Optional[List[str]] = None) -> int:
    import warnings

    from ..runtime.blas import load_optimized_blas

    with warnings.catch_warnings(record=True) as caught:  # one clean line each, not a warning trace
        warnings.simplefilter("always")
        load_optimized_blas()
    for w in caught:
        print(f"kvpolicy: warning: {str(w.message).removeprefix('kvpolicy: ')}", file=sys.stderr)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # mlx-lm's server options pass through unparsed
        from .serve import main as serve_main

        return serve_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_numbers(args)
        _check_given(args, _given(parser, argv))
        if args.command in ("generate", "eval"):
            from ..runtime.distributed import rank_zero_output

            with rank_zero_output():  # under mlx.launch, only rank 0 prints
                return args.func(args)
        return args.func(args)
    except KeyboardInterrupt:
        from ..runtime.progress import end_line

        end_line()
        return 130
    except Exception as exc:  # the program's top: any other error is said in one line (KVPOLICY_DEBUG=1: raised)
        from ..runtime.progress import end_line

        end_line()  # a stage stopped mid-line on a terminal: the error starts on its own line
        if os.environ.get("KVPOLICY_DEBUG"):
            raise
        from ..errors import KVPolicyError
        from ..model.default import ModelUnavailable

        if isinstance(exc, (CLIError, KVPolicyError, ModelUnavailable, ValueError, FileNotFoundError)):
            print(f"kvpolicy: error: {exc}", file=sys.stderr)
            return 2
        print(
            f"kvpolicy: unexpected error: {type(exc).__name__}: {exc} (KVPOLICY_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 1


def entry() -> None:
    """The ``kvpolicy`` console command: :func:`main`, then stdout and stderr flushed and the process ended with
    ``os._exit`` (as ``kvpolicy serve`` ends), not by tearing the interpreter down: MLX's C++ threads torn down
    during interpreter shutdown after an error could abort the process ("terminate called without an active
    exception", exit 134) instead of giving its exit status (2 for a refused input)."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said on it
            pass
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":  # pragma: no cover
    entry()
