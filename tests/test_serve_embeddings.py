"""/v1/embeddings through the official openai client, and /v1/rerank, against Model.embed and
sentence-transformers on tiny models (tests/embedding_models.py); bad bodies are 400s in
OpenAI's error shape."""

from __future__ import annotations

import base64

import numpy as np
import pytest

import infer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")
pytest.importorskip("uvicorn")
pytest.importorskip("sentence_transformers")

from infer.serve import create_app  # noqa: E402

from embedding_models import TEXTS, model_dir  # noqa: E402
from test_serve import running  # noqa: E402

NAME = "tiny-embed"


@pytest.fixture(scope="module")
def url():
    with running(create_app(infer.load(model_dir("st_bert"), backend="numpy"), model_name=NAME)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir("st_bert")), device="cpu")


def test_openai_client_embeds_like_sentence_transformers(client, reference):
    reply = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    got = np.asarray([d.embedding for d in reply.data], np.float32)
    np.testing.assert_allclose(got, reference.encode(TEXTS), atol=2e-5)
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
    assert reply.model == NAME


def test_float_format_string_and_token_ids(client, reference):
    one = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, reference.encode([TEXTS[0]])[0], atol=2e-5)
    model = infer.load(model_dir("st_bert"), backend="numpy")
    ids = [model.tokenizer.encode(t) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model=NAME, input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in by_ids.data], reference.encode(TEXTS[:2]), atol=2e-5)
    single = client.embeddings.create(model=NAME, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, reference.encode(TEXTS[:1])[0], atol=2e-5)


def test_base64_is_little_endian_float32(url, reference):
    r = httpx.post(url + "/v1/embeddings", json={"model": NAME, "input": TEXTS[:2], "encoding_format": "base64"})
    assert r.status_code == 200
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]]
    np.testing.assert_allclose(rows, reference.encode(TEXTS[:2]), atol=2e-5)


def test_dimensions(client):
    reply = client.embeddings.create(model=NAME, input=TEXTS, dimensions=8, encoding_format="float")
    rows = np.asarray([d.embedding for d in reply.data])
    assert rows.shape == (len(TEXTS), 8)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": {"a": 1}}, "input"),
    ({}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 1000}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": [[]]}, "input"),
    ({"input": [[10**9]]}, "input"),
    ({"input": [[5] * 500]}, "input"),
])
def test_bad_requests_are_400(url, body, param):
    r = httpx.post(url + "/v1/embeddings", json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_bad_request_through_client(client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=NAME, input=[])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")


def test_rerank_endpoint():
    from sentence_transformers import CrossEncoder

    folder = model_dir("bert_cross")
    query = "What is the capital of France?"
    want = CrossEncoder(str(folder), device="cpu").predict([(query, d) for d in TEXTS])
    with running(create_app(infer.load(folder, backend="numpy"), model_name="ce")) as base:
        r = httpx.post(base + "/v1/rerank", json={"model": "ce", "query": query, "documents": TEXTS, "top_n": 3,
                                                  "return_documents": True})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-want)[:3])
        np.testing.assert_allclose([x["relevance_score"] for x in results], np.sort(want)[::-1][:3], atol=2e-5)
        assert results[0]["document"]["text"] == TEXTS[results[0]["index"]]
        r = httpx.post(base + "/rerank", json={"model": "ce", "query": query, "documents": [{"text": TEXTS[0]}]})
        assert r.status_code == 200 and len(r.json()["results"]) == 1
        for bad, param in (({"documents": []}, "documents"), ({"query": 3}, "query"), ({"top_n": 0}, "top_n")):
            body = {"model": "ce", "query": query, "documents": TEXTS, **bad}
            r = httpx.post(base + "/v1/rerank", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_generation_on_an_encoder_is_400(url, client):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=NAME, prompt="the sun", max_tokens=2)
    with pytest.raises(openai.BadRequestError):  # (this one has no chat template either)
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("name", ["st_qwen3", "st_gemma3"])
def test_decoder_embedders_through_the_client(name):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(model_dir(name)), device="cpu").encode(TEXTS, prompt_name="query")
    with running(create_app(infer.load(model_dir(name), backend="numpy"), model_name=name)) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        reply = client.embeddings.create(model=name, input=TEXTS, extra_body={"prompt_name": "query"})
        np.testing.assert_allclose([d.embedding for d in reply.data], want, atol=2e-5)
