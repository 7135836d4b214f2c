"""Compress once, ask many: ``kvpolicy cache-prompt`` writes one prompt-cache file that ``kvpolicy generate
--prompt-cache``, mlx-lm's own ``generate --prompt-cache-file`` and ``kvpolicy serve --prompt-cache`` answer
questions from, each in a new process, each question from its own copy of the compressed caches: the answers
equal asking each question against a fresh in-memory copy here, and the file is never changed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
import threading

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from server_kit import Server

from kvpolicy_core import KVCacheBuilder
from kvpolicy_core.apps.prompt_file import document_ids, file_metadata, question_ids
from kvpolicy_core.integration.compress_once import compress_context, repeat_prompt
from kvpolicy_core.testing.tiny_models import write_model_dir

pytestmark = pytest.mark.slow  # every test starts new processes

METHOD = "cam:budget=32,n_sink=2"
STEP = 64  # prefill chunk: the document is prefilled in several chunks, evicting between them
DOCUMENT = (
    "the quick brown fox jumps over the lazy dog. " * 4
    + "the secret number is 4821. "
    + "hello world, how are you today? " * 3
)
QUESTIONS = ("what is the secret number?", "who jumps over the dog?")
MAX_TOKENS = 12


def _cli(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return out


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompt-file")
    write_model_dir(d / "model", "llama", layers=2)
    (d / "doc.txt").write_text(DOCUMENT)
    out = _done(
        _cli(
            "kvpolicy_core.apps.cli",
            "cache-prompt",
            "--model",
            str(d / "model"),
            "--file",
            str(d / "doc.txt"),
            "--method",
            METHOD,
            "--prefill-step-size",
            str(STEP),
            "--compress-once",
            "stream",
            "--prompt-cache-file",
            str(d / "doc.safetensors"),
            "--json",
        )
    )
    return d, json.loads(out)


@pytest.fixture(scope="module")
def reference(compressed):
    """Each question's answer (text, token ids) from a fresh in-memory copy of the document's caches."""
    d, _ = compressed
    model, tokenizer = mlx_lm.load(str(d / "model"))
    caches = KVCacheBuilder.for_model(model, METHOD + ",when=stream")  # as --compress-once stream makes them
    for _ in generate_step(
        mx.array(document_ids(tokenizer, DOCUMENT)), model, max_tokens=0, prompt_cache=caches, prefill_step_size=STEP
    ):
        pass
    answers = {}
    for q in QUESTIONS:
        ids = [
            r.token
            for r in mlx_lm.stream_generate(
                model, tokenizer, question_ids(tokenizer, q), max_tokens=MAX_TOKENS, prompt_cache=copy.deepcopy(caches)
            )
        ]
        answers[q] = (tokenizer.decode(ids), ids)
    return answers, len(document_ids(tokenizer, DOCUMENT))


def test_the_file_records_the_method_and_the_compression(compressed, reference):
    d, summary = compressed
    metadata, info = file_metadata(d / "doc.safetensors")
    n_doc = reference[1]
    assert metadata["method"] == "cam" and metadata["budget"] == "32" and metadata["tokens_seen"] == str(n_doc)
    assert metadata["tokens_kept"] == "32.0" and metadata["max_tokens_kept"] == "32"
    assert float(metadata["compression_ratio"]) == pytest.approx(n_doc / 32, abs=1e-4)
    assert info["config"]["budget"] == 32 and info["prefill_step_size"] == STEP and len(info["document_ids"]) == n_doc
    assert summary["tokens_seen"] == n_doc and summary["method"] == "cam"


def test_questions_from_the_file_in_new_processes_equal_a_fresh_copy_each(compressed, reference):
    d, _ = compressed
    path = d / "doc.safetensors"
    before = _sha(path)
    kvpolicy = {
        q: _cli("kvpolicy_core.apps.cli", "generate", "--prompt-cache", str(path), q, "--max-tokens", str(MAX_TOKENS))
        for q in QUESTIONS
    }
    mlx = {
        q: _cli(
            "kvpolicy_core.apps.with_mlx_lm",
            "generate",
            "--prompt-cache-file",
            str(path),
            "--prompt",
            q,
            "--max-tokens",
            str(MAX_TOKENS),
            "--verbose",
            "False",
        )
        for q in QUESTIONS
    }
    answers = reference[0]
    assert answers[QUESTIONS[0]] != answers[QUESTIONS[1]]
    for q in QUESTIONS:
        assert _done(kvpolicy[q]).removesuffix("\n") == answers[q][0], q
        assert _done(mlx[q]).removesuffix("\n") == answers[q][0], q
    assert _sha(path) == before


def test_serve_answers_every_request_that_extends_the_document_from_a_copy(compressed, reference):
    d, _ = compressed
    path = d / "doc.safetensors"
    before = _sha(path)
    server = Server(["--prompt-cache", str(path), "--max-tokens", str(MAX_TOKENS)])
    try:
        for i, q in enumerate(QUESTIONS + QUESTIONS[:1]):
            status, body = server.post(
                "/v1/completions", {"prompt": DOCUMENT + q, "max_tokens": MAX_TOKENS, "logprobs": True}
            )
            assert status == 200, body
            ids = [c["id"] for c in body["choices"][0]["logprobs"]["content"]]
            assert ids == reference[0][q][1], q
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            # a new question starts from the document's copy; a repeated one from mlx-lm's own stored longer prefix
            assert cached == reference[1] if i < len(QUESTIONS) else cached > reference[1], (q, cached)
        assert server.stats()["method"] == "cam"
    finally:
        server.stop()
    assert _sha(path) == before


def test_a_prompt_cache_with_another_method_or_model_is_refused(compressed, tmp_path):
    d, _ = compressed
    other = write_model_dir(tmp_path / "other", "llama", layers=2, seed=1)
    path = str(d / "doc.safetensors")
    for args, needle in (
        (["generate", "--prompt-cache", path, "q", "--method", "h2o"], "the method comes from the file"),
        (
            ["generate", "--prompt-cache", path, "q", "--model", str(other)],
            "is not the model the prompt cache was made with",
        ),
        (["serve", "--prompt-cache", path, "--method", "h2o"], "is not the method of --prompt-cache"),
        (["serve", "--prompt-cache", path, "--model", str(other)], "is not the model of"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "kvpolicy_core.apps.cli", *args], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-1000:]


@pytest.fixture(scope="module")
def kvzip_file(compressed):
    """The document written by cache-prompt's default (kvzip: each layer keeps its own number of tokens), and
    each question's answer from a fresh in-memory copy of the same compression."""
    d, _ = compressed
    path = d / "kvzip.safetensors"
    args = ["kvpolicy_core.apps.cli", "cache-prompt", "--model", str(d / "model"), "--file", str(d / "doc.txt")]
    args += ["--method", METHOD, "--prefill-step-size", str(STEP), "--prompt-cache-file", str(path), "--json"]
    summary = json.loads(_done(_cli(*args)))
    assert summary["compress_once"] == "kvzip"
    model, tokenizer = mlx_lm.load(str(d / "model"))
    ids = document_ids(tokenizer, DOCUMENT)
    caches = compress_context(model, ids, METHOD, prefill_step=STEP, repeat=repeat_prompt(tokenizer)).caches
    assert len({c.size() for c in caches}) > 1  # per-layer budgets: the case one batch mask cannot serve
    answers = {}
    for q in QUESTIONS:
        answers[q] = [
            r.token
            for r in mlx_lm.stream_generate(
                model, tokenizer, question_ids(tokenizer, q), max_tokens=MAX_TOKENS, prompt_cache=copy.deepcopy(caches)
            )
        ]
    return path, answers, len(ids)


def test_serve_a_kvzip_file_answers_requests_that_extend_the_document_as_a_fresh_copy_does(kvzip_file):
    """Before: HTTP 500 ``[broadcast_shapes]`` for every such request (one batch mask from layer 0's length)."""
    path, answers, n_doc = kvzip_file
    before = _sha(path)
    server = Server(["--prompt-cache", str(path), "--max-tokens", str(MAX_TOKENS)])
    try:

        def ask(q, out):
            out[q] = server.post(
                "/v1/completions", {"prompt": DOCUMENT + q, "max_tokens": MAX_TOKENS, "logprobs": True}
            )

        for together in ([QUESTIONS[0]], list(QUESTIONS)):  # one request, then two in one batch
            got = {}
            threads = [threading.Thread(target=ask, args=(q, got)) for q in together]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for q in together:
                status, body = got[q]
                assert status == 200, body
                assert [c["id"] for c in body["choices"][0]["logprobs"]["content"]] == answers[q], q
        # a prompt that does not extend the document: served from scratch, with notice
        status, body = server.post("/v1/completions", {"prompt": "hello " + DOCUMENT, "max_tokens": 2})
        assert status == 200, body
        doc = server.stats()["prompt_cache_file"]
        assert doc["document_tokens"] == n_doc and doc["requests_not_extending"] == 1
        assert doc["requests_extending"] == 3 and doc["last_not_extending"]["first_difference"] == 0
    finally:
        log = server.stop()
    assert "does not extend the --prompt-cache document (it differs from the document at token 0)" in log
    assert _sha(path) == before
