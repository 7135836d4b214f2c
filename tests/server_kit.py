"""Helpers for the server tests: a tiny mlx-lm model directory, a real `kvpolicy serve` process, HTTP."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?"] * 20


def save_tiny_model_dir(path: Path, seed: int = 0) -> Path:
    """A tiny random-weight llama saved as an mlx-lm model directory, with a byte-level BPE
    tokenizer (trained offline on a two-line corpus) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvpolicy_core.testing.tiny_models import write_tiny_llama_dir

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "bos_token": "<bos>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return write_tiny_llama_dir(path, seed=seed, vocab=tok.get_vocab_size(), tokenizer=False, eos_token_id=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `kvpolicy serve` subprocess on a free loopback port."""

    def __init__(self, args: List[str], timeout: float = 120.0, prelude: str = "") -> None:
        """``prelude``: Python run in the server process before the CLI (e.g. to inject a fault)."""
        self.port = free_port()
        entry = (
            ["-c", f"{prelude}\nimport sys\nfrom kvpolicy_core.apps.cli import main\nsys.exit(main(sys.argv[1:]))"]
            if prelude
            else ["-m", "kvpolicy_core.apps.cli"]
        )
        cmd = [sys.executable, *entry, "serve", "--port", str(self.port), *args]
        # SIGINT restored to its default in the child, as at a terminal: a test run started in the
        # background by a non-interactive shell inherits SIGINT ignored, and Ctrl-C (stop()) would do nothing
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        # drain the server's log as it is written: an undrained pipe fills (64 KiB) and blocks the
        # server's next log line, and with it the generation thread that writes it
        self._lines: List[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.stop()}")
            with contextlib.suppress(OSError):
                status, _ = self.get("/health")
                if status == 200:
                    return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not come up")

    def request(
        self,
        method: str,
        path: str,
        body: Optional[bytes] = None,
        headers: Optional[dict] = None,
        timeout: float = 120.0,
    ) -> Tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def raw_post(self, path: str, headers: bytes, body: bytes, timeout: float = 30.0) -> Tuple[int, bytes]:
        """POST with hand-written header lines (bytes, CRLF-separated); (status, body) or (0, b"") if dropped."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as conn:
            conn.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n\r\n" + body)
            conn.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
        if not data:
            return 0, b""
        head, _, rest = data.partition(b"\r\n\r\n")
        return int(head.split()[1]), rest

    def get(self, path: str) -> Tuple[int, bytes]:
        return self.request("GET", path, timeout=5)

    def post(self, path: str, payload) -> Tuple[int, dict]:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, body = self.request("POST", path, raw, {"Content-Type": "application/json"})
        return status, json.loads(body) if body.strip().startswith(b"{") else {"raw": body.decode(errors="replace")}

    def stream(self, path: str, payload) -> Iterator[dict]:
        """POST with stream=true; yields each SSE `data:` event (JSON), ending at [DONE]."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(
                "POST", path, json.dumps({**payload, "stream": True}).encode(), {"Content-Type": "application/json"}
            )
            r = conn.getresponse()
            assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    yield {"done": True}
                    return
                yield json.loads(data)
        finally:
            conn.close()

    def stats(self) -> dict:
        status, body = self.get("/kvpolicy/stats")
        assert status == 200
        return json.loads(body)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)  # Ctrl-C waits for the generation step in flight (slow on a loaded machine)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        return "".join(self._lines)

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)


#: the method the tiny-model server tests share
TINY_METHOD = "cam:budget=8,n_sink=2"


def tiny_server(model_dir: Path) -> "Server":
    """A server of :data:`TINY_METHOD` on the tiny model in ``model_dir``, 4 tokens per request by default."""
    return Server(["--model", str(model_dir), "--method", TINY_METHOD, "--max-tokens", "4"])
