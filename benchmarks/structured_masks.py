"""Token-mask time per token of three structured-generation libraries.

For each tokenizer (a Hugging Face ``tokenizer.json``) and each constraint (a
JSON schema and a regex), each library compiles the constraint, then walks one
valid output token by token: compute the mask of allowed next tokens (timed),
then accept the token. The figures in docs/structured.md come from::

    python benchmarks/structured_masks.py TOKENIZER_DIR [TOKENIZER_DIR ...]

with SmolLM2-135M's tokenizer (49,152 ids) and Gemma 3 270M's (262,144 ids), the
folders tests/reference.py and tests/real_models.py build (``--decode FOLDER`` also
times infer's own decode step there, for scale). A library that is not
installed is skipped (xgrammar pulls triton as a dependency; for this script
``pip install --no-deps xgrammar apache-tvm-ffi`` suffices).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "score"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["red", "blue"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "score": 9.75}
REGEX = r"\d{3}-\d{3}-\d{4} \((home|work|mobile)\)"
REGEX_TEXT = "555-867-5309 (mobile)"


def _load(folder: Path) -> tuple[Any, str, int, int]:
    from tokenizers import Tokenizer

    text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    tok = Tokenizer.from_str(text)
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    generation = json.loads((folder / "generation_config.json").read_text())
    eos = generation.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return tok, text, int(config["vocab_size"]), int(eos)


def bench_llguidance(folder: Path, kind: str, constraint: str, tokens: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.numpy as lln

    _, text, vocab, eos = _load(folder)
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
    t1 = time.perf_counter()
    grammar = llguidance.grammar_from("json_schema" if kind == "json" else "regex", constraint)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    t2 = time.perf_counter()
    mask = lln.allocate_token_bitmask(1, vocab)

    def step(token: int) -> None:
        lln.fill_next_token_bitmask(matcher, mask)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance rejected token {token}: {matcher.get_error()}")

    return _walk(step, tokens, t1 - t0, t2 - t1, lambda: lln.fill_next_token_bitmask(matcher, mask))


def bench_xgrammar(folder: Path, kind: str, constraint: str, tokens: list[int]) -> dict[str, Any]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    _, _, vocab, eos = _load(folder)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(constraint) if kind == "json" else compiler.compile_regex(constraint)
    matcher = xgrammar.GrammarMatcher(compiled)
    t2 = time.perf_counter()
    mask = xgrammar.allocate_token_bitmask(1, vocab)

    def step(token: int) -> None:
        matcher.fill_next_token_bitmask(mask)
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token}")

    return _walk(step, tokens, t1 - t0, t2 - t1, lambda: matcher.fill_next_token_bitmask(mask))


def bench_outlines_core(folder: Path, kind: str, constraint: str, tokens: list[int]) -> dict[str, Any]:
    import llguidance  # only to decode each token to its bytes, as outlines' from_pretrained would
    import numpy as np
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tok, text, vocab, eos = _load(folder)
    lltok = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
    t0 = time.perf_counter()
    words: dict[bytes, list[int]] = {}
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        if i != eos and not lltok.is_special_token(i):
            b = lltok.decode_bytes([i])
            if b:
                words.setdefault(b, []).append(i)
    vocabulary = Vocabulary(eos, words)
    t1 = time.perf_counter()
    regex = build_regex_from_schema(constraint) if kind == "json" else constraint
    guide = Guide(Index(regex, vocabulary))
    t2 = time.perf_counter()
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def step(token: int) -> None:
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        guide.advance(token)

    return _walk(step, tokens, t1 - t0, t2 - t1,
                 lambda: guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize))


def _walk(step: Callable[[int], None], tokens: list[int], setup: float, compile_s: float,
          last: Callable[[], None]) -> dict[str, Any]:
    times = []
    for token in tokens:
        t = time.perf_counter()
        step(token)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    last()  # the mask after the output: end-of-sequence only
    times.append(time.perf_counter() - t)
    return {"tokenizer_s": setup, "compile_s": compile_s, "tokens": len(times),
            "mean_us": 1e6 * statistics.fmean(times), "median_us": 1e6 * statistics.median(times),
            "max_us": 1e6 * max(times)}


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines_core}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders with tokenizer.json, config.json, "
                        "generation_config.json")
    parser.add_argument("--decode", type=Path, default=None,
                        help="also time infer's decode step on this model folder (numpy), for scale")
    args = parser.parse_args()
    if args.decode is not None:
        import infer

        model = infer.load(args.decode, backend="numpy")
        ids = model.tokenizer.encode("The capital of France is")
        list(model.generate_tokens(ids, max_tokens=4, ignore_eos=True))  # warm up
        t = time.perf_counter()
        list(model.generate_tokens(ids, max_tokens=32, ignore_eos=True))
        print(f"infer numpy decode: {1e3 * (time.perf_counter() - t) / 32:.1f} ms/token ({args.decode.name})")
    cases = [("json", json.dumps(SCHEMA), json.dumps(INSTANCE, separators=(",", ":"))), ("regex", REGEX, REGEX_TEXT)]
    rows = []
    for folder in args.folders:
        tok, _, vocab, _ = _load(folder)
        for kind, constraint, output in cases:
            tokens = tok.encode(output, add_special_tokens=False).ids
            for name, bench in LIBRARIES.items():
                try:
                    r = bench(folder, kind, constraint, tokens)
                except ImportError as exc:
                    print(f"{name}: not installed ({exc})")
                    continue
                rows.append((vocab, kind, name, r))
                print(json.dumps({"vocab": vocab, "constraint": kind, "library": name, **r}), flush=True)
    print("\n| vocabulary | constraint | library | mask, mean µs/token | median | max | compile s | tokenizer s |")
    print("|---|---|---|---|---|---|---|---|")
    for vocab, kind, name, r in rows:
        print(f"| {vocab:,} | {kind} | {name} | {r['mean_us']:.0f} | {r['median_us']:.0f} | {r['max_us']:.0f} | "
              f"{r['compile_s']:.3f} | {r['tokenizer_s']:.2f} |")


if __name__ == "__main__":
    main()
