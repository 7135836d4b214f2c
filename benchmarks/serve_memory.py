"""``kvpolicy serve --kv-memory``: MLX's measured memory of the server while concurrent long requests run.

Starts ``kvpolicy serve`` on the default model (or ``--model``) with ``--kv-memory``, reads ``/kvpolicy/stats``
before any request (the model and the server's own memory: the baseline), sends ``--requests`` long prompts at
once, then reads the peak. Reported: the peak above the baseline against the limit, each request's kept K/V bytes,
and whether each concurrent answer equals the same request alone.

    python benchmarks/serve_memory.py --kv-memory 64MB --requests 4 --tokens 2048
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

from _harness import parser, result_name, write_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(port: int, method: str, path: str, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def _answer(port: int, prompt: str, max_tokens: int):
    status, data = _call(
        port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "logprobs": True}
    )
    assert status == 200, data
    return [c["id"] for c in json.loads(data)["choices"][0]["logprobs"]["content"]]


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--method", default="cam:when=stream")
    p.add_argument("--kv-memory", default="64MB")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="words per prompt (about as many tokens)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prefill-step", type=int, default=256)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.requests = 64, 2
    from kvpolicy_core.config.cache_config import parse_bytes
    from kvpolicy_core.model.corpus import default_corpus

    limit = parse_bytes(args.kv_memory)
    words = default_corpus().split()
    prompts = [
        " ".join(words[i * 997 : i * 997 + args.tokens]) + " In one sentence, this is about"
        for i in range(args.requests)
    ]
    port = _free_port()
    half = args.requests // 2 or 1
    cmd = [sys.executable, "-m", "kvpolicy_core.apps.cli", "serve", "--port", str(port), "--method", args.method]
    cmd += ["--kv-memory", args.kv_memory, "--decode-concurrency", str(half), "--prompt-concurrency", str(half)]
    cmd += ["--prefill-step-size", str(args.prefill_step)] + (["--model", args.model] if args.model else [])
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if _call(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        base = json.loads(_call(port, "GET", "/kvpolicy/stats")[1])
        together = [None] * args.requests
        threads = [
            threading.Thread(target=lambda i=i: together.__setitem__(i, _answer(port, prompts[i], args.max_tokens)))
            for i in range(args.requests)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        after = json.loads(_call(port, "GET", "/kvpolicy/stats")[1])
        alone = [_answer(port, q, args.max_tokens) for q in prompts]
    finally:
        server.terminate()
        server.wait(timeout=60)
    peak = after["memory"]["peak_bytes"] - base["memory"]["active_bytes"]
    kept = [r["kv_bytes_kept"] for r in after["recent"]]
    row = {
        "limit": limit,
        "budget": after["budget"],
        "peak_above_model": peak,
        "peak_vs_limit": peak / limit,
        "kept_per_request": kept,
        "kept_sum": sum(kept),
        "same_as_alone": together == alone,
        "seconds": seconds,
    }
    print(
        f"--kv-memory {args.kv_memory} ({limit} B), {args.requests} requests of ~{args.tokens} words: budget "
        f"{row['budget']}, peak above the model {peak / 2**20:.1f} MiB (x{row['peak_vs_limit']:.2f} of the limit), "
        f"kept {sum(kept) / 2**20:.2f} MiB in all, answers as alone: {row['same_as_alone']}"
    )
    print(f"wrote {write_json(result_name('serve_memory', args), {'row': row}, args.out)}")


if __name__ == "__main__":
    main()
