"""Texts per second of ``Model.embed`` (numpy, torch:cpu) against sentence-transformers
(torch, CPU) on the same model, in the same run. The figure in docs/performance.md
comes from::

    python benchmarks/embeddings.py --texts 256 --repeats 3

The model is a random BERT of all-MiniLM-L6-v2's shape (hidden 384, 6 layers of 12
heads, MLP 1536; tests/embedding_models.py's WordPiece vocabulary, so only the
embedding table is smaller), mean pooling and Normalize, saved by
sentence-transformers; the texts are tests/reference.py's training sentences cut to
8-60 words (about 10-70 tokens), in a fixed shuffled order. Each side embeds all texts
``--repeats`` times after one warm-up; the best time counts. Both read the same
vectors (checked: cosine 1 within 1e-5).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def build(folder: Path) -> None:
    import torch
    import transformers
    from embedding_models import _bert_tokenizer, randomize
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.normalize import Normalize
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    bare = folder / "bare"
    bare.mkdir(parents=True)
    vocab = _bert_tokenizer(bare)
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    randomize(model)
    model.save_pretrained(bare)
    SentenceTransformer(modules=[Transformer(str(bare)), Pooling(384, "mean"), Normalize()], device="cpu").save(
        str(folder / "st"))


def texts(n: int) -> list[str]:
    from reference import _TRAINING_TEXT

    words = _TRAINING_TEXT.split()
    rng = random.Random(0)
    out = []
    for _ in range(n):
        k = rng.randint(8, 60)
        start = rng.randint(0, len(words) - k)
        out.append(" ".join(words[start:start + k]))
    return out


def best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size")
    args = p.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    import infer

    data = texts(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder)
        st = SentenceTransformer(str(folder / "st"), device="cpu")
        want = st.encode(data, batch_size=args.batch_size)
        rows = {"sentence-transformers (torch cpu)": best(lambda: st.encode(data, batch_size=args.batch_size),
                                                           args.repeats)}
        for backend in ("numpy", "torch:cpu"):
            model = infer.load(folder / "st", backend=backend)
            got = model.embed(data)
            assert np.abs((got * want).sum(axis=1) - 1).max() < 1e-5, "the vectors differ"
            rows[f"infer {backend}"] = best(lambda: model.embed(data), args.repeats)
        tokens = sum(len(model.tokenizer.encode(t)) for t in data)
    report = {"texts": args.texts, "tokens": tokens, "torch_threads": torch.get_num_threads(),
              "texts_per_s": {k: round(args.texts / v, 1) for k, v in rows.items()}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
