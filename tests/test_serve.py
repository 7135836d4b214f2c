"""`kvpolicy serve`: mlx-lm's server with policy caches, tested over HTTP against a real process.

A tiny random-weight model directory keeps these fast; the default model is tested once
(integration) with the issue's own acceptance run.
"""

import json
import threading
import time

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from server_kit import Server, save_tiny_model_dir

from kvpolicy_core import attach, detach

# The default scoring (observed signal, observation window 32, pool 15): every served answer below
# must equal the prompt generated alone, prompt-cache reuse and concurrent batching included.
METHOD = "cam:budget=8,n_sink=2"
LONG = "the quick brown fox jumps over the lazy dog. hello world, how are you today? " * 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = Server(["--model", str(tiny_dir), "--method", METHOD, "--max-tokens", "16"])
    yield s
    out = s.stop()
    assert s.proc.returncode == 0, f"Ctrl-C must stop the server cleanly:\n{out[-2000:]}"


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Greedy (ids, logprobs) of a text prompt generated alone in this process, fresh caches."""
    model, tokenizer = mlx_lm.load(str(tiny_dir))
    attach(model, METHOD)

    def run(prompt: str, max_tokens: int):
        ids, lps = [], []
        for (t, lp), _ in zip(
            generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=max_tokens), range(max_tokens)
        ):
            ids.append(t)
            lps.append(lp[t].item())
            if t in tokenizer.eos_token_ids:
                break
        return ids, lps

    yield run
    detach(model)


def completion(server, prompt, max_tokens, **extra):
    status, body = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "logprobs": True, **extra}
    )
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    return [c["id"] for c in content], [c["logprob"] for c in content], body


def assert_same(got, want):
    ids, lps = got
    want_ids, want_lps = want
    assert ids == want_ids
    assert lps == pytest.approx(want_lps, abs=1e-4)


def test_chat_completion(server):
    status, body = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello world, how are you today?"}], "max_tokens": 6},
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert 1 <= body["usage"]["completion_tokens"] <= 6


def test_text_completion_equals_the_prompt_generated_alone(server, reference):
    got = completion(server, "the quick brown fox", 8)
    assert_same(got[:2], reference("the quick brown fox", 8))
    assert got[2]["object"] == "text_completion"


def test_streaming_sse(server):
    events = list(
        server.stream(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "the lazy dog"}], "max_tokens": 5}
        )
    )
    assert events[-1] == {"done": True}
    chunks = [e for e in events[:-1] if e.get("choices")]
    assert chunks and all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_two_concurrent_requests_each_equal_their_prompt_alone(server, reference):
    # the second request arrives while the first (300 tokens) is decoding: it joins the batch
    prompts = [(LONG, 300), ("hello world, how are you", 40)]
    results = [None, None]

    def go(i):
        results[i] = completion(server, *prompts[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    threads[0].start()
    time.sleep(0.3)
    threads[1].start()
    for t in threads:
        t.join(timeout=300)
    for (prompt, n), got in zip(prompts, results):
        assert got is not None
        assert_same(got[:2], reference(prompt, n))
    assert len(results[0][0]) == 300
    assert server.stats()["peak_batch"] == 2  # they were decoded together


def test_prompt_longer_than_the_budget_holds_the_budget(server):
    before = server.stats()["requests_finished"]
    ids, _, body = completion(server, LONG, 4)
    assert body["usage"]["prompt_tokens"] > 8
    stats = server.stats()
    assert stats["method"] == "cam" and stats["budget"] == 8 and stats["batching"] is True
    assert stats["requests_finished"] == before + 1
    last = stats["recent"][-1]
    assert last["tokens_seen"] == body["usage"]["prompt_tokens"] + len(ids)  # the last token was fed too
    assert last["max_tokens_kept"] <= 8 and all(k <= 8 for k in last["tokens_kept_per_layer"])
    assert last["compression_ratio"] > 1 and last["kv_bytes_kept"] < last["kv_bytes_full"]
    memory = stats["memory"]  # measured by MLX's allocator, beside the accounted bytes
    assert memory["peak_bytes"] >= memory["active_bytes"] > last["kv_bytes_kept"]


def test_unbatched_path_serves_and_records_too(server, reference):
    # mlx-lm serves a request with a seed alone (stream_generate), not through the batch
    before = server.stats()["requests_finished"]
    got = completion(server, "walrus " + LONG, 5, seed=3)
    assert_same(got[:2], reference("walrus " + LONG, 5))
    stats = server.stats()
    assert stats["requests_finished"] == before + 1 and stats["recent"][-1]["max_tokens_kept"] == 8


def test_prompt_cache_reuse_after_evictions_is_never_stale(server, reference):
    # prompts start with words no other test uses, so only this test's stored caches can match
    long_prompt = "zebra " + LONG
    # 1) a long request: its stored cache has evicted tokens (it cannot be trimmed)
    first = completion(server, long_prompt, 6)
    assert first[2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_same(first[:2], reference(long_prompt, 6))
    # 2) a strict prefix of the stored prompt: an evicted cache must not be trimmed and reused
    prefix = long_prompt[:40].rstrip()
    assert_same(completion(server, prefix, 6)[:2], reference(prefix, 6))
    # 3) the same long request again reuses its own stored prompt cache and gives the same answer
    again = completion(server, long_prompt, 6)
    assert again[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert_same(again[:2], first[:2])


def test_a_prompt_that_extends_a_stored_prompt_equals_the_prompt_alone(server, reference):
    # mlx-lm stores each batched prompt's cache before its last token; a later prompt that extends
    # it is prefilled from there, in another chunk than alone. Nothing is evicted in the stored
    # part (3 tokens, budget 8), so the two chunks are one run: scored as the prompt in one chunk.
    short = "koala fox jumps"
    completion(server, short, 2)
    longer = short + " over the lazy dog. hello world, how are you today? the quick brown fox"
    got = completion(server, longer, 12)
    assert got[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the stored prefix was used
    assert_same(got[:2], reference(longer, 12))


def test_prompt_cache_is_not_trimmed_into_stale_scores(server, reference):
    # a short request that stays within the budget: its cache has no evictions, but its scores carry
    # attention from its last tokens, so it cannot be trimmed to serve a shorter prompt
    # (PolicyCache.is_trimmable is False). mlx-lm also stored its cache before its last token, which
    # is exactly the next prompt: an exact match leaves nothing to feed, so the server looks up the
    # prompt without its last token instead (before, mlx-lm's generation thread died on it).
    completion(server, "quokka dog fox", 1)
    assert_same(completion(server, "quokka dog", 10)[:2], reference("quokka dog", 10))
    assert_same(completion(server, "quokka dog", 10)[:2], reference("quokka dog", 10))  # served again


def test_bad_requests_get_http_errors_and_the_server_keeps_serving(server):
    status, body = server.request("POST", "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    assert status == 400
    status, body = server.post("/v1/completions", {"prompt": "x", "max_tokens": -3})
    assert status == 400 and "max_tokens" in body["error"]
    status, body = server.post("/v1/completions", {"prompt": "x", "kvpolicy": "h2o:budget=4"})
    assert status == 400 and "per-request method is not supported" in body["error"] and "cam" in body["error"]
    status, _ = server.request("POST", "/v1/nowhere", b"{}")
    assert status == 404
    status, _ = server.get("/health")
    assert status == 200
    assert len(completion(server, "hello", 2)[0]) >= 1


@pytest.mark.parametrize(
    "method, needle",
    [
        ("nosuch", "unknown method 'nosuch'"),
        ("cam:budget=0", "budget"),
        ("cam:merge=sideways", "merge"),
        ("missing.toml", "no such file"),
        ('{"method": "h2o", "budget": "many"}', "budget"),
    ],
)
def test_bad_method_is_a_clear_error_before_anything_loads(tiny_dir, method, needle, capsys):
    from kvpolicy_core.apps import serve

    assert serve.main(["--model", str(tiny_dir), "--method", method]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpolicy serve: error:") and needle in err


def test_bad_method_fails_the_command_at_start_up(tiny_dir):
    with pytest.raises(RuntimeError) as info:
        Server(["--model", str(tiny_dir), "--method", "cam:budget=8,n_sink=9"])
    assert "exited with 2" in str(info.value) and "n_sink" in str(info.value)


def test_method_from_json_and_toml_files(tmp_path):
    from kvpolicy_core.apps.serve import load_method

    (tmp_path / "m.toml").write_text('method = "h2o"\nbudget = 6\nn_sink = 1\n')
    (tmp_path / "m.json").write_text('{"method": "cam", "budget": 7, "merge": "mean"}')
    assert load_method(str(tmp_path / "m.toml")).policy.budget == 6
    cfg = load_method(str(tmp_path / "m.json"))
    assert cfg.method == "cam" and cfg.policy.budget == 7 and cfg.policy.merge == "mean"
    (tmp_path / "bad.toml").write_text("method = ")
    with pytest.raises(Exception, match="invalid TOML"):
        load_method(str(tmp_path / "bad.toml"))


@pytest.mark.integration
@pytest.mark.slow
def test_default_model_cam_64_two_concurrent_chats():
    """The issue's acceptance run: `kvpolicy serve --method "cam:budget=64"`, two concurrent chats."""
    s = Server(["--method", "cam:budget=64", "--max-tokens", "8"], timeout=300)
    try:
        question = "Explain in detail how the Roman republic became an empire. " * 6
        results = [None, None]

        def chat(i):
            results[i] = s.post(
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": question if i == 0 else "Write a haiku about autumn."}],
                    "max_tokens": 8,
                },
            )

        threads = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for status, body in results:
            assert status == 200, body
            assert body["choices"][0]["message"]["content"].strip()
        stats = s.stats()
        assert stats["method"] == "cam" and stats["budget"] == 64 and stats["batching"] is True
        assert stats["requests_finished"] == 2 and stats["peak_batch"] == 2
        for r in stats["recent"]:
            assert all(k <= 64 for k in r["tokens_kept_per_layer"])
        assert max(r["tokens_seen"] for r in stats["recent"]) > 64  # the long chat went past the budget
        print(json.dumps(stats))
    finally:
        s.stop()


def test_the_end_of_prompt_cut_serves_requests_batches_and_a_growing_chat_within_its_budget(tiny_dir):
    """`--method h2o:when=prompt_end`: each request and two concurrent ones answer as their prompt alone; a chat
    whose reused prompt cache grows each turn is cut at each turn's end and never keeps more than the budget."""
    method = "h2o:budget=8,n_sink=2,when=prompt_end"
    s = Server(["--model", str(tiny_dir), "--method", method, "--max-tokens", "8"])
    try:
        model, tokenizer = mlx_lm.load(str(tiny_dir))
        attach(model, method)

        def alone(prompt, n):
            ids = []
            for (t, _), _ in zip(generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=n), range(n)):
                ids.append(t)
                if t in tokenizer.eos_token_ids:
                    break
            return ids

        prompts = [("emu " + LONG, 12), ("emu hello world, how are you", 10)]
        results = [None, None]

        def go(i):
            results[i] = completion(s, *prompts[i])[0]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for (prompt, n), got in zip(prompts, results):
            assert got == alone(prompt, n)
        detach(model)
        messages = []
        for turn in ("the quick brown fox", "hello world, how are you today?", "the lazy dog " * 4):
            messages.append({"role": "user", "content": turn})
            status, body = s.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6})
            assert status == 200, body
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            last = s.stats()["recent"][-1]
            assert last["tokens_seen"] > 8 and all(k <= 8 for k in last["tokens_kept_per_layer"])
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the chat reused its prompt cache
    finally:
        s.stop()


@pytest.mark.integration
@pytest.mark.slow
def test_default_model_chat_reusing_its_prompt_cache_keeps_its_budget_and_the_first_turns_fact():
    """A chat of three turns through `kvpolicy serve` (the default cut at each turn's end, `cam:budget=160`, about
    3x by the last turn), each request extending the last one so mlx-lm's prompt cache is reused: every layer keeps
    at most its budget, and the last turn's question about the first turn is answered as the full cache answers it."""
    from kvpolicy_core.model.corpus import default_corpus
    from kvpolicy_core.model.default import ensure_default_model

    text = default_corpus()[20000:21400]
    doc = text[:700] + " One of the special magic numbers for quiet-harbor is: 4721939. " + text[700:]
    turns = [
        f"Read this text.\n{doc}\nRemember the special magic number for quiet-harbor.",
        "Say hello in one word.",
        "What is the special magic number for quiet-harbor?",
    ]
    prefix = "One of the special magic numbers for quiet-harbor is:"
    s = Server(["--method", "cam:budget=160", "--max-tokens", "12"], timeout=600)
    try:
        conversation, kept = "", []
        for i, turn in enumerate(turns):
            conversation += f"<start_of_turn>user\n{turn}<end_of_turn>\n<start_of_turn>model\n"
            if i == len(turns) - 1:
                conversation += prefix
            status, body = s.post("/v1/completions", {"prompt": conversation, "max_tokens": 12 if i == 2 else 6})
            assert status == 200, body
            answer = body["choices"][0]["text"]
            kept.append(s.stats()["recent"][-1])
            if i < len(turns) - 1:
                conversation += answer + "<end_of_turn>\n"
        assert all(k <= 160 for r in kept for k in r["tokens_kept_per_layer"]) and kept[-1]["tokens_seen"] > 400
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the chat reused its prompt cache
        model, tokenizer = mlx_lm.load(str(ensure_default_model("float32")))
        full = mlx_lm.generate(model, tokenizer, conversation, max_tokens=12)
        assert "4721939" in full  # the full cache answers it
        assert "4721939" in answer, answer
    finally:
        s.stop()
