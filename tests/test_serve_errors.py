"""`kvpolicy serve` under bad input: every bad request is a clear HTTP error and the server keeps serving;
a failure inside generation fails only the requests it held; a server that cannot start says why, once."""

import json
import socket
import subprocess
import sys
import time

import pytest
from server_kit import Server, free_port, tiny_server

METHOD = "cam:budget=8,n_sink=2"
CONTENT_ONLY_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # an empty message formats to ""

# Injected into the server process: the batched loop fails when a request asks for 13 tokens.
FAULT_AT_13_TOKENS = """
from mlx_lm.generate import BatchGenerator
_insert = BatchGenerator.insert_segments
def insert_segments(self, *args, max_tokens=None, **kwargs):
    if max_tokens == [13]:
        raise RuntimeError("injected fault")
    return _insert(self, *args, max_tokens=max_tokens, **kwargs)
BatchGenerator.insert_segments = insert_segments
"""


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = tiny_server(tiny_dir)
    yield s
    s.stop()


def assert_serving(server):
    assert server.get("/health")[0] == 200
    status, body = server.post("/v1/completions", {"prompt": "hello world", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_empty_prompt_is_a_400_and_the_server_keeps_serving(server):
    # the tiny tokenizer adds no BOS: "" has no tokens (mlx-lm's batch fails on it and its thread dies)
    for stream in (False, True):
        status, body = server.post("/v1/completions", {"prompt": "", "max_tokens": 2, "stream": stream})
        assert status == 400 and "prompt: no tokens after tokenization" in body["error"], body
        assert_serving(server)
    status, body = server.post("/v1/chat/completions", {"messages": [], "max_tokens": 2})
    assert status == 400 and "messages must be a non-empty list" in body["error"]
    assert_serving(server)


@pytest.mark.parametrize(
    "headers, body, needle",
    [
        (b"Content-Length: \xb2", b'{"prompt": "x"}', "Invalid Content-Length header"),  # '²' is a digit to isdigit()
        (b"Content-Length: +43", b'{"prompt": "x", "kvpolicy": "h2o:budget=4"}', "Invalid Content-Length header"),
        (b"Content-Length: 500", b'{"prompt": "x"}', "ended after 15 of the 500 bytes"),
        (b"Content-Length: 3", b"\xff\xfe{", "not UTF-8"),
        (b"Content-Length: 100000", b"[" * 100000, "nested too deeply"),
    ],
)
def test_malformed_http_requests_are_400s_naming_the_problem(server, headers, body, needle):
    status, raw = server.raw_post("/v1/completions", headers + b"\r\nContent-Type: application/json", body)
    assert status == 400 and needle in json.loads(raw)["error"], raw
    assert_serving(server)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"method": "h2o:budget=4"}, "method: a per-request method is not supported"),
        ({"kvpolicy": "h2o:budget=4"}, "kvpolicy: a per-request method is not supported"),
        ({"prompt": 5}, "prompt must be of type str"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),  # mlx-lm's thread died on it
        ({"chat_template_kwargs": 3}, "chat_template_kwargs must be an object"),
        ({"logit_bias": {"100000": 2.0}}, "logit_bias: token id 100000 is outside the vocabulary"),  # was a segfault
        ({"logit_bias": {"-1": 2.0}}, "logit_bias: token id -1 is outside the vocabulary"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(server, extra, needle):
    status, body = server.post("/v1/completions", {"prompt": "hello", "max_tokens": 2, **extra})
    assert status == 400 and needle in body["error"], body
    assert server.proc.poll() is None
    assert_serving(server)


def test_kv_bits_the_model_cannot_be_quantized_to_is_refused_at_start_up(tiny_dir):
    # --kv-bits goes into the policy caches (they store their rows quantized, and mlx-lm batches them); a head dim
    # (the tiny model's 16) that no group size divides is refused before serving, naming the field
    with pytest.raises(RuntimeError, match="kv_group_size: 64 does not divide the model's head dim 16"):
        Server(["--model", str(tiny_dir), "--method", METHOD, "--kv-bits", "8"])


def test_empty_prompts_are_refused(tiny_dir):
    s = Server(
        ["--model", str(tiny_dir), "--method", METHOD, "--max-tokens", "4", "--chat-template", CONTENT_ONLY_TEMPLATE]
    )
    try:
        status, body = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]})
        assert status == 400 and "messages: the formatted chat has no tokens" in body["error"], body
        status, body = s.post("/v1/completions", {"prompt": "", "max_tokens": 2})
        assert status == 400 and "prompt: no tokens" in body["error"], body  # mlx-lm: a 404
        status, body = s.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert s.stats()["requests_finished"] == 1
    finally:
        s.stop()


def test_a_failure_in_generation_fails_the_requests_it_held_and_the_server_keeps_serving(tiny_dir):
    s = Server(["--model", str(tiny_dir), "--method", METHOD, "--max-tokens", "4"], prelude=FAULT_AT_13_TOKENS)
    try:
        # a request in the middle of decoding when the loop fails: its stream ends with an error event
        long = s.stream("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 5000})
        first = next(long)
        assert first["choices"], first
        status, body = s.post("/v1/completions", {"prompt": "hello", "max_tokens": 13})
        assert status == 500 and "generation failed: RuntimeError: injected fault" in body["error"], body
        rest = list(long)  # ends promptly: the held request is failed, not left waiting
        assert rest and "injected fault" in rest[-1]["error"] and {"done": True} not in rest
        assert_serving(s)
        # the loop restarted: another failure is again one request's error
        events = list(s.stream("/v1/completions", {"prompt": "hello", "max_tokens": 13}))
        assert "injected fault" in events[-1]["error"]
        assert_serving(s)
        assert s.stats()["batching"] is True
    finally:
        out = s.stop()
    assert s.proc.returncode == 0, out[-2000:]


def _serve(tiny_dir, *args):
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "kvpolicy_core.apps.cli", "serve", "--model", str(tiny_dir), "--method", METHOD, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stderr, time.monotonic() - t0


def test_a_busy_port_is_one_error_line_and_exit_2(tiny_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err, seconds = _serve(tiny_dir, "--port", str(port))
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert code == 2 and "Traceback" not in err, err
    assert errors == [
        f"kvpolicy serve: error: --host 127.0.0.1 --port {port}: cannot listen there: Address already in use"
    ], err
    assert seconds < 60  # it exits: no generation thread is left to keep it alive


def test_a_port_out_of_range_is_refused_not_wrapped(tiny_dir):
    port = 65536 + free_port()  # getaddrinfo would quietly listen on free_port()
    code, err, _ = _serve(tiny_dir, "--port", str(port))
    assert (
        code == 2
        and err.strip().splitlines()[-1] == f"kvpolicy serve: error: --port {port}: not a port number (0 to 65535)"
    ), err
