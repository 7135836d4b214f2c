"""`kvpolicy serve`'s inputs: a request's seed, non-finite sampling values and a ``messages`` that is not a list of
objects are 400s naming the field (the server keeps serving); every numeric server option is checked at start-up
(one line naming it, exit 2, before the model loads); ``/health`` answers 503 while the generation loop holds
requests and makes no progress."""

import json
import subprocess
import sys
import threading
import time

import pytest
from server_kit import Server, free_port, tiny_server

METHOD = "cam:budget=8,n_sink=2"


@pytest.fixture(scope="module")
def server(tiny_dir):
    s = tiny_server(tiny_dir)
    yield s
    s.stop()


@pytest.mark.parametrize(
    "path, raw, field",
    [
        ("/v1/completions", b'{"prompt": "hello", "max_tokens": 2, "seed": -1}', "seed"),
        ("/v1/completions", b'{"prompt": "hello", "max_tokens": 2, "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", b'{"prompt": "hello", "max_tokens": 2, "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"prompt": "hello", "max_tokens": 2, "temperature": Infinity}', "temperature"),
        ("/v1/completions", b'{"prompt": "hello", "max_tokens": 2, "top_p": NaN}', "top_p"),
        ("/v1/completions", b'{"prompt": "hello", "max_tokens": 2, "logit_bias": {"5": NaN}}', "logit_bias"),
        ("/v1/chat/completions", b'{"messages": "hi", "max_tokens": 2}', "messages"),
        ("/v1/chat/completions", b'{"messages": ["hi"], "max_tokens": 2}', "messages"),
    ],
)
def test_bad_sampling_values_and_messages_are_400s_naming_the_field(server, path, raw, field):
    status, body = server.post(path, raw)
    assert status == 400 and body["error"].startswith(field), body
    assert "attribute" not in body["error"]
    status, body = server.post("/v1/completions", {"prompt": "hello world", "max_tokens": 2, "seed": 2**64 - 1})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


@pytest.mark.parametrize(
    "option, value",
    [
        ("--prefill-step-size", "0"),
        ("--max-tokens", "-5"),
        ("--decode-concurrency", "0"),
        ("--prompt-concurrency", "0"),
        ("--top-p", "nan"),
        ("--temp", "inf"),
        ("--prompt-cache-size", "-1"),
    ],
)
def test_bad_server_options_are_refused_at_start_up_naming_them(tiny_dir, option, value):
    cmd = [sys.executable, "-m", "kvpolicy_core.apps.cli", "serve", "--port", str(free_port())]
    cmd += ["--model", str(tiny_dir), option, value]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"kvpolicy serve: error: {option} must be" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# The batched loop's step hangs for 8 s once a request asks for 13 tokens; a stall counts after 1 s.
STALL_AFTER_13_TOKENS = """
import time
import kvpolicy_core.apps.serve as serve
from mlx_lm.generate import BatchGenerator
serve.STALL_SECONDS = 1.0
_insert, _next, _hang = BatchGenerator.insert_segments, BatchGenerator.next, []
def insert_segments(self, *args, max_tokens=None, **kwargs):
    if max_tokens == [13]:
        _hang.append(1)
    return _insert(self, *args, max_tokens=max_tokens, **kwargs)
def next(self):
    if _hang:
        _hang.clear()
        time.sleep(8)
    return _next(self)
BatchGenerator.insert_segments, BatchGenerator.next = insert_segments, next
"""


def test_health_is_503_while_the_generation_loop_makes_no_progress(tiny_dir):
    s = Server(["--model", str(tiny_dir), "--method", METHOD], prelude=STALL_AFTER_13_TOKENS)
    try:
        done = {}
        t = threading.Thread(
            target=lambda: done.update(r=s.post("/v1/completions", {"prompt": "hello world", "max_tokens": 13}))
        )
        t.start()
        seen = []
        deadline = time.monotonic() + 7
        while time.monotonic() < deadline and not (seen and seen[-1][0] == 503):
            time.sleep(0.3)
            seen.append(s.get("/health"))
        status, body = seen[-1]
        assert status == 503 and json.loads(body)["status"] == "stalled", seen
        t.join(timeout=120)
        assert done["r"][0] == 200, done
        assert s.get("/health")[0] == 200
    finally:
        s.stop()
