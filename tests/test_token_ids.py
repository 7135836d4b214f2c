"""Token ids checked against the model's vocabulary wherever they enter: JSONL contexts,
``compress_context`` and the server's prompts. An id past the embedding is an out-of-bounds read (10**9
segfaulted; 5000 with a vocabulary of 97 ran silently): each is refused before any model call, naming its source."""

import json
import types

import mlx.core as mx
import numpy as np
import pytest
from helpers import VOCAB, tiny_llama, tiny_model

from kvpolicy_core.eval.tasks import ruler
from kvpolicy_core.integration.token_ids import TokenIdError, check_token_ids, model_vocab_size


def test_the_vocabulary_is_the_models_embedding_rows():
    assert model_vocab_size(tiny_llama()) == VOCAB
    assert model_vocab_size(tiny_model("gemma3_text")) == VOCAB
    assert model_vocab_size(types.SimpleNamespace(args=types.SimpleNamespace(vocab_size=50))) == 50
    assert model_vocab_size(object()) is None


@pytest.mark.parametrize("ids", [[1, 2, 5000], [10**9], np.array([3, 97]), mx.array([[1, 2], [300, 4]]), [-1]])
def test_an_id_outside_the_vocabulary_is_refused_naming_where_it_came_from(ids):
    with pytest.raises(TokenIdError, match=r"^prompts\.jsonl:3\.context_ids: token id -?\d+ .*outside .*\(0 to 96\)"):
        check_token_ids(ids, VOCAB, "prompts.jsonl:3.context_ids")


def test_ids_inside_the_vocabulary_pass():
    for ids in ([0, 1, 96], np.array([5, 96]), mx.array([[0, 96]]), [], mx.array([], dtype=mx.int32)):
        check_token_ids(ids, VOCAB, "x")
    with pytest.raises(TokenIdError, match="not an integer"):
        check_token_ids([1, True], VOCAB, "x")
    with pytest.raises(TokenIdError, match="must be integers"):
        check_token_ids(mx.array([1.0]), VOCAB, "x")


def record(context_ids, question_ids=(5, 6)):
    return {
        "id": "c0",
        "task": "niah_single",
        "length": 64,
        "context_ids": list(context_ids),
        "questions": [{"question_ids": list(question_ids), "answers": ["1"], "max_new_tokens": 4}],
    }


def test_jsonl_ids_are_checked_against_the_models_vocabulary(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(record([1, 2, 3])) + "\n" + json.dumps(record([1, 5000])) + "\n")
    assert len(ruler.read_jsonl(path)) == 2  # no model: the ids are only non-negative integers
    with pytest.raises(TokenIdError, match=r"prompts\.jsonl:2\.context_ids: token id 5000 at index 1 .*0 to 96"):
        ruler.read_jsonl(path, VOCAB)
    path.write_text(json.dumps(record([1, 2], question_ids=[10**9])) + "\n")
    with pytest.raises(TokenIdError, match=r"prompts\.jsonl:1: questions\[0\]\.question_ids: token id 1000000000"):
        ruler.read_jsonl(path, VOCAB)


@pytest.mark.parametrize("field, value", [("length", 10**12), ("max_new_tokens", 10**9)])
def test_jsonl_counts_are_bounded(tmp_path, field, value):
    rec = record([1, 2, 3])
    (rec if field == "length" else rec["questions"][0])[field] = value
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=rf"{field}: expected an integer in \[1, 1048576\]"):
        ruler.read_jsonl(path)


def test_compress_context_refuses_ids_outside_the_vocabulary_before_any_prefill(monkeypatch):
    from kvpolicy_core.integration import compress_once

    model = tiny_llama()
    monkeypatch.setattr(compress_once.KVCacheBuilder, "for_model", lambda *a, **k: pytest.fail("built caches"))
    for bad in (5000, 10**9):
        with pytest.raises(TokenIdError, match=rf"compress_context: context_ids: token id {bad} at index 7"):
            compress_once.compress_context(model, list(range(7)) + [bad] + list(range(30)), "h2o:budget=16")


def test_the_server_refuses_a_prompt_whose_ids_are_outside_the_vocabulary():
    from kvpolicy_core.apps.serve import _server_classes
    from kvpolicy_core.apps.serve_requests import BadRequest

    generator = _server_classes().ResponseGenerator
    fake = types.SimpleNamespace(model_provider=types.SimpleNamespace(vocab_size=VOCAB, processor=None))
    tokenizer = types.SimpleNamespace(encode=lambda text: [ord(c) - 60 for c in text])  # ids past the model's
    request = types.SimpleNamespace(request_type="text", prompt="ab\u4e00")
    with pytest.raises(BadRequest, match=r"^prompt: token id 19908 at index 2 is outside .*0 to 96"):
        generator.pretokenize(fake, tokenizer, request, None)
    ok = types.SimpleNamespace(request_type="text", prompt="ab")
    generator.pretokenize(fake, tokenizer, ok, None)
    assert ok._kvpolicy_tokenized[1][0] == [37, 38]
