"""Model.embed against sentence-transformers and transformers float32 on tiny random models
(tests/embedding_models.py): pooled vectors, prompts, truncation, Dense and Normalize
modules, and the same vector for a text alone and in any batch."""

from __future__ import annotations

import numpy as np
import pytest

import infer
from infer.errors import EmbeddingError

from embedding_models import TEXTS, model_dir

pytest.importorskip("sentence_transformers")
BACKENDS = ["numpy", "torch:cpu", "mlx:cpu"]
ATOL = 2e-5  # float32 rounding of unit vectors


def _backend(name: str) -> str:
    if name.startswith("mlx"):
        pytest.importorskip("mlx.core")
    return name


@pytest.fixture(scope="module",
                params=["st_bert", "st_bert_cls", "st_distilbert", "st_roberta", "st_qwen3", "st_gemma3"])
def st_name(request):
    return request.param


def _st(name: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir(name)), device="cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_sentence_transformers(st_name, backend):
    model = infer.load(model_dir(st_name), backend=_backend(backend))
    want = _st(st_name).encode(TEXTS, convert_to_numpy=True, batch_size=2)
    got = model.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_prompts_match_sentence_transformers(st_name):
    st = _st(st_name)
    model = infer.load(model_dir(st_name), backend="numpy")
    for name in st.prompts:
        np.testing.assert_allclose(model.embed(TEXTS, prompt_name=name), st.encode(TEXTS, prompt_name=name),
                                   atol=ATOL)
    np.testing.assert_allclose(model.embed(TEXTS, prompt="zzz: "), st.encode(TEXTS, prompt="zzz: "), atol=ATOL)


def test_alone_equals_batched(st_name):
    model = infer.load(model_dir(st_name), backend="numpy")
    batched = model.embed(TEXTS + TEXTS[::-1])
    alone = np.concatenate([model.embed(t) for t in TEXTS])
    np.testing.assert_allclose(batched[: len(TEXTS)], alone, atol=1e-6)
    np.testing.assert_allclose(batched[len(TEXTS):], alone[::-1], atol=1e-6)
    small = model.embed(TEXTS, max_batch_tokens=8)  # one text per forward, and long ones alone
    np.testing.assert_allclose(small, alone, atol=1e-6)


def test_truncates_like_sentence_transformers():
    st = _st("st_bert")  # max_seq_length 24
    model = infer.load(model_dir("st_bert"), backend="numpy")
    long = " ".join(TEXTS * 3)
    assert len(model.tokenizer.encode(long)) > 24
    np.testing.assert_allclose(model.embed([long, "the sun"]), st.encode([long, "the sun"]), atol=ATOL)


@pytest.mark.parametrize("mode", ["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"])
@pytest.mark.parametrize("include_prompt", [True, False])
def test_pooling_modes(mode, include_prompt):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    folder = model_dir("bert")
    st = SentenceTransformer(modules=[Transformer(str(folder)), Pooling(64, mode, include_prompt=include_prompt)],
                             device="cpu")
    model = infer.load(folder, backend="numpy")
    if include_prompt:
        want = st.encode(TEXTS)
        np.testing.assert_allclose(model.embed(TEXTS, pooling=mode, normalize=False), want, atol=ATOL, rtol=1e-5)
    else:  # the Pooling module is the folder's: build it the way a saved one reads
        st.save(str(folder.parent / ".pool-tmp"))
        want = st.encode(TEXTS, prompt="query: ")
        saved = infer.load(folder.parent / ".pool-tmp", backend="numpy")
        np.testing.assert_allclose(saved.embed(TEXTS, prompt="query: ", normalize=False), want, atol=ATOL, rtol=1e-5)


def test_multiple_pooling_modes_concatenate():
    model = infer.load(model_dir("bert"), backend="numpy")
    both = model.embed(TEXTS, pooling=["cls", "mean"], normalize=False)
    np.testing.assert_allclose(both[:, :64], model.embed(TEXTS, pooling="cls", normalize=False), atol=1e-6)
    np.testing.assert_allclose(both[:, 64:], model.embed(TEXTS, pooling="mean", normalize=False), atol=1e-6)


def test_bare_bert_matches_transformers():
    import torch
    import transformers

    folder = model_dir("bert")
    hf = transformers.BertModel.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = infer.load(folder, backend="numpy")
    got = model.embed(TEXTS, normalize=False)  # a bare BertModel: mean pooling
    for i, text in enumerate(TEXTS):
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            states = hf(**enc).last_hidden_state[0].numpy()
        np.testing.assert_allclose(got[i], states.mean(axis=0), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(model.embed(text, pooling="cls", normalize=False)[0], states[0], atol=1e-5,
                                   rtol=1e-5)


def test_bare_qwen3_matches_transformers():
    import torch
    import transformers

    folder = model_dir("st_qwen3")  # the folder holds the bare Qwen3Model's weights (no model. prefix)
    hf = transformers.Qwen3Model.from_pretrained(folder, dtype=torch.float32).eval()
    model = infer.load(folder, backend="numpy")
    for text in TEXTS[:3]:
        ids = model.tokenizer.encode(text)
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
        unit = lambda v: v / np.linalg.norm(v)  # noqa: E731  (the folder ends in a Normalize module)
        np.testing.assert_allclose(model.embed(text)[0], unit(states[-1]), atol=ATOL)
        np.testing.assert_allclose(model.embed([ids], pooling="mean")[0], unit(states.mean(axis=0)), atol=ATOL)


def test_dimensions_truncate_then_normalize():
    model = infer.load(model_dir("st_bert"), backend="numpy")
    full = model.embed(TEXTS)
    cut = model.embed(TEXTS, dimensions=8)
    assert cut.shape == (len(TEXTS), 8)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(cut, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=1e-6)
    raw = model.embed(TEXTS, dimensions=8, normalize=False)
    np.testing.assert_allclose(raw, full[:, :8], atol=1e-6)


def test_token_ids_equal_text():
    model = infer.load(model_dir("st_bert"), backend="numpy")
    ids = [model.tokenizer.encode(t) for t in TEXTS]
    np.testing.assert_allclose(model.embed(ids), model.embed(TEXTS), atol=1e-6)
    np.testing.assert_allclose(model.embed(ids[0]), model.embed(TEXTS[0]), atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    ([], "empty"), ([""], None), ("x", None), ([[]], "empty"), ([[10**6]], "vocabulary"), ([1.5], "must be"),
])
def test_bad_inputs(bad, message):
    model = infer.load(model_dir("st_bert"), backend="numpy")
    if bad == [""] or bad == "x":  # an empty text still has [CLS] [SEP]: it embeds
        assert model.embed(bad).shape == (1, 32)
        return
    with pytest.raises(EmbeddingError, match=message):
        model.embed(bad)


def test_bad_options():
    model = infer.load(model_dir("st_bert"), backend="numpy")
    with pytest.raises(EmbeddingError, match="dimensions"):
        model.embed(TEXTS, dimensions=33)
    with pytest.raises(EmbeddingError, match="prompt_name"):
        model.embed(TEXTS, prompt_name="nope")
    with pytest.raises(EmbeddingError, match="pooling"):
        model.embed(TEXTS, pooling="median")
    with pytest.raises(EmbeddingError, match="at most"):
        model.embed([[5] * 100])


def test_dense_pickle_refused(tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dir("st_bert"), folder)
    dense = folder / "2_Dense"
    (dense / "model.safetensors").unlink()
    (dense / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(infer.errors.UnsafeFormatError, match="pickle"):
        infer.load(folder, backend="numpy")


# -- reranking -------------------------------------------------------------------------------

QUERY = "What is the capital of France?"


@pytest.mark.parametrize("name", ["bert_cross", "bert_cross2", "roberta_cross"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_encoder_matches_sentence_transformers(name, backend):
    import torch
    from sentence_transformers import CrossEncoder

    folder = model_dir(name)
    ce = CrossEncoder(str(folder), device="cpu")
    model = infer.load(folder, backend=_backend(backend))
    got = np.asarray(model.rerank(QUERY, TEXTS))
    want = ce.predict([(QUERY, d) for d in TEXTS], convert_to_numpy=True)
    if want.ndim == 2:  # two labels: infer scores the softmax probability of the last
        want = torch.softmax(torch.from_numpy(want), -1)[:, -1].numpy()
    np.testing.assert_allclose(got, want, atol=2e-5)
    # alone as in a batch
    np.testing.assert_allclose([model.rerank(QUERY, [d])[0] for d in TEXTS], got, atol=1e-6)


def test_cross_encoder_uses_token_types():
    model = infer.load(model_dir("bert_cross"), backend="numpy")
    paired = model.rerank(QUERY, TEXTS[:1])[0]
    joined = model.rerank(QUERY + " " + TEXTS[0], [""])[0]  # the same words, all in the first segment
    assert abs(paired - joined) > 1e-4


def test_qwen3_reranker_matches_transformers(monkeypatch):
    import torch
    import transformers

    from infer.embedding import DEFAULT_RERANK_INSTRUCTION, QWEN3_RERANK_PREFIX, QWEN3_RERANK_SUFFIX
    from reference import tiny_model_dir

    folder = tiny_model_dir("qwen3")  # a Qwen3ForCausalLM, scored as Qwen3-Reranker does
    model = infer.load(folder, backend="numpy")
    tok = model.tokenizer
    real = tok.token_to_id  # the tiny vocabulary has no 'yes' and 'no': two other tokens stand in for them
    monkeypatch.setattr(tok, "token_to_id", lambda t: {"yes": 100, "no": 200}.get(t) or real(t))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    docs = [t for t in TEXTS if len(t) < 60]  # prompt and all within the tiny model's 256 positions
    want = []
    for doc in docs:
        ids = (tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
               + tok.encode(f"<Instruct>: {DEFAULT_RERANK_INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {doc}",
                            add_special_tokens=False)
               + tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False))
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
        pair = torch.stack([logits[tok.token_to_id("no")], logits[tok.token_to_id("yes")]])
        want.append(torch.softmax(pair, 0)[1].item())
    np.testing.assert_allclose(model.rerank(QUERY, docs), want, atol=2e-5)
    long = model.rerank(QUERY, [" ".join(TEXTS * 4)])  # past the context: the document is cut, the prompt kept
    assert 0 <= long[0] <= 1


def test_encoder_without_classifier_does_not_rerank():
    model = infer.load(model_dir("st_bert"), backend="numpy")
    with pytest.raises(EmbeddingError, match="rerank"):
        model.rerank(QUERY, TEXTS)
    with pytest.raises(EmbeddingError, match="documents"):
        model.rerank(QUERY, [])


def test_gguf_pooling_type(tmp_path):
    """A GGUF file's ``{arch}.pooling_type`` chooses the pooling (written and read back)."""
    from infer.formats.gguf_arch import POOLING_TYPES
    from infer.formats.gguf_write import write_gguf
    from infer.formats.huggingface import open_folder
    from reference import tiny_model_dir

    folder = tiny_model_dir("llama2")  # a llama decoder, which infer writes as GGUF
    for pooling, mode in (("mean", "mean"), ("last", "lasttoken"), ("cls", "cls")):
        package = open_folder(folder)
        package.config["pooling_type"] = pooling
        path = tmp_path / f"{pooling}.gguf"
        write_gguf(package, path, type="f32")
        package.tensors.close()
        model = infer.load(path, backend="numpy")
        assert model.config["pooling_type"] == pooling and pooling in POOLING_TYPES.values()
        want = infer.load(folder, backend="numpy").embed(TEXTS, pooling=mode)
        np.testing.assert_allclose(model.embed(TEXTS), want, atol=1e-5)


def test_cli_embed(tmp_path, capsys):
    import json

    from infer.tools.cli import main

    file = tmp_path / "in.txt"
    file.write_text("\n".join(TEXTS[:3]) + "\n", encoding="utf-8")
    assert main(["-q", "embed", str(model_dir("st_bert")), str(file), "--backend", "numpy", "--dimensions", "8"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = infer.load(model_dir("st_bert"), backend="numpy").embed(TEXTS[:3], dimensions=8)
    np.testing.assert_allclose(rows, want, atol=1e-6)
    assert main(["-q", "embed", str(model_dir("st_bert")), str(tmp_path / "missing.txt")]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["lasttoken", "weightedmean"])
def test_bare_llama_model_lowercased(tmp_path, mode):
    """A bare LlamaModel folder (no model. prefix, no head) under sentence-transformers, with
    sentence_bert_config.json's do_lower_case."""
    import json

    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    from embedding_models import _bpe_tokenizer, randomize

    config = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    bare = transformers.LlamaModel(config)
    randomize(bare)
    bare.save_pretrained(tmp_path / "bare")
    _bpe_tokenizer(tmp_path / "bare", eos_after=True)
    SentenceTransformer(modules=[Transformer(str(tmp_path / "bare")), Pooling(64, mode), Normalize()],
                        device="cpu").save(str(tmp_path / "st"))
    path = tmp_path / "st" / "sentence_bert_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_lower_case": True}))
    want = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(infer.load(tmp_path / "st", backend="numpy").embed(TEXTS), want, atol=ATOL)


def test_any_batch_equals_alone():
    """Property: any selection and order of texts, in forwards of any token budget, embeds each
    text as it embeds alone (no padding or other text leaks into a row)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    models = {name: infer.load(model_dir(name), backend="numpy") for name in ("st_bert", "st_gemma3")}
    alone = {name: np.concatenate([m.embed(t) for t in TEXTS]) for name, m in models.items()}

    @settings(max_examples=20, deadline=None)
    @given(st.sampled_from(sorted(models)), st.lists(st.integers(0, len(TEXTS) - 1), min_size=1, max_size=8),
           st.integers(1, 200))
    def check(name, picks, budget):
        got = models[name].embed([TEXTS[i] for i in picks], max_batch_tokens=budget)
        np.testing.assert_allclose(got, alone[name][picks], atol=1e-6)

    check()


def test_cross_encoder_activation_from_config(tmp_path):
    """config.json's sentence_transformers.activation_fn (what CrossEncoder.save writes) sets the score."""
    import json
    import shutil

    from sentence_transformers import CrossEncoder

    folder = tmp_path / "ce"
    shutil.copytree(model_dir("bert_cross"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    want = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in TEXTS])
    got = infer.load(folder, backend="numpy").rerank(QUERY, TEXTS)
    np.testing.assert_allclose(got, want, atol=2e-5)
    sigmoid = infer.load(model_dir("bert_cross"), backend="numpy").rerank(QUERY, TEXTS)
    np.testing.assert_allclose(sigmoid, 1 / (1 + np.exp(-np.asarray(got))), atol=1e-6)  # the default on the logits
