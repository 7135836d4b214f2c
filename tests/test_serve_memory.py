"""``kvpolicy serve --kv-memory``: the requests in flight share one memory limit with the prefill step's own memory
(measured at start-up); each request's budget is chosen so that its cache, its prefill chunk included, stays within
its share, and concurrent requests answer as alone."""

from __future__ import annotations

import threading

import pytest
from server_kit import Server

KV_ROOM = 64_000  # bytes for the caches of --decode-concurrency 2 + --prompt-concurrency 2 requests
OPTIONS = ["--decode-concurrency", "2", "--prompt-concurrency", "2", "--prefill-step-size", "16", "--max-tokens", "6"]
PROMPTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 7 for i in range(4)]


def _ids(server, prompt):
    status, body = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "logprobs": True})
    assert status == 200, body
    return [c["id"] for c in body["choices"][0]["logprobs"]["content"]]


def _prefill_bytes(tiny_dir) -> int:
    """The prefill step's own memory as the server measures it at start-up (2 prompts of 16 tokens)."""
    import mlx_lm

    from kvpolicy_core.apps.serve import prefill_transient

    return prefill_transient(mlx_lm.load(str(tiny_dir))[0], 2, 16, 4)


@pytest.mark.slow
def test_concurrent_requests_share_the_limit_and_answer_as_alone(tiny_dir):
    limit = _prefill_bytes(tiny_dir) + KV_ROOM  # the prefill step's room (the server measures it again, within ~1%)
    server = Server(
        ["--model", str(tiny_dir), "--method", "cam:n_sink=2,when=stream", "--kv-memory", str(limit), *OPTIONS]
    )
    try:
        together, threads = [None] * 4, []
        for i, p in enumerate(PROMPTS):
            threads.append(threading.Thread(target=lambda i=i, p=p: together.__setitem__(i, _ids(server, p))))
            threads[-1].start()
        for t in threads:
            t.join()
        stats = server.stats()
        alone = [_ids(server, p) for p in PROMPTS]
    finally:
        log = server.stop()
    assert together == alone, log
    share = limit / 4
    recent = stats["recent"]
    assert len(recent) == 4 and 2 < stats["budget"] < 60  # the budget the limit chose (the default, 512, holds all)
    assert all(0 < r["kv_bytes_kept"] <= share and r["max_tokens_kept"] == stats["budget"] for r in recent)
    assert stats["memory"]["active_bytes"] > 0


@pytest.mark.parametrize(
    "method, limit, said",
    [
        ("cam:n_sink=2", "64kB", "holds each prompt whole until its cut"),
        ("cam:n_sink=2,when=stream", "8kB", "beside the prefill step's own memory"),
    ],
)
@pytest.mark.slow
def test_a_limit_that_cannot_hold_is_refused_at_start_up(tiny_dir, method, limit, said):
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        Server(["--model", str(tiny_dir), "--method", method, "--kv-memory", limit, *OPTIONS])
    assert said in str(err.value)
