"""Size, quality, time and peak memory of ``infer convert`` for every GGUF type.

    python benchmarks/convert_quality.py HF_FOLDER [-o results/convert-smollm2.json]

Each conversion runs in a fresh process (so its peak resident memory is its own);
then each file is loaded with infer's numpy backend and its teacher-forced logits
over a fixed text are compared with those of the f32 file: the RMS error relative
to the logits' RMS, the mean KL divergence from the f32 distribution (nats per
token), and how often the top token agrees. The numbers of docs/convert.md come
from this script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TYPES = ["f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k", "q5_1", "q5_0", "q4_k_m", "q4_k", "q4_1", "q4_0"]

# A fixed English text, written for this measurement.
TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He checked the lamp, "
    "wiped the salt from the windows, and wrote a short line in the logbook about the weather and the "
    "ships he had seen. Most nights were quiet. Fishing boats came home before dark, and the cargo "
    "ships kept far from the rocks. But on the night of the great storm, the wind tore a shutter from "
    "its hinges and the waves rose higher than the harbour wall. The keeper lit the lamp early and "
    "stayed awake until morning, counting the flashes and listening for horns in the fog."
)

# Peak memory is the process's VmHWM (reset by exec); ru_maxrss would inherit the parent's.
_CONVERT = """
import re, sys, time
import infer
start = time.perf_counter()
infer.convert(sys.argv[1], sys.argv[2], type=sys.argv[3], progress=False)
seconds = time.perf_counter() - start
status = open("/proc/self/status").read()
print(seconds, int(re.search(r"VmHWM:\\s+(\\d+) kB", status)[1]) * 1024)
"""


def convert(src: str, out: Path, kind: str) -> tuple[float, int]:
    done = subprocess.run([sys.executable, "-c", _CONVERT, src, str(out), kind], check=True,
                          capture_output=True, text=True)
    seconds, peak = done.stdout.split()
    return float(seconds), int(peak)


def teacher_forced_logits(path: Path, ids: list[int]) -> np.ndarray:
    import infer

    model = infer.load(path, backend="numpy")
    engine = model.engine
    return model.backend.to_numpy(engine.forward(engine.new_sequence(), ids, all_logits=True)).astype(np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="Hugging Face folder to convert")
    parser.add_argument("-o", "--output", default=None, help="JSON file for the results")
    parser.add_argument("--memory-only", action="store_true", help="only time and peak memory, no quality")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(Path(args.src) / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = None
        for kind in TYPES:
            out = Path(tmp) / f"model.{kind}.gguf"
            seconds, peak = convert(args.src, out, kind)
            if kind == "f32":  # and the way back: GGUF -> Hugging Face folder
                back_seconds, back_peak = convert(str(out), Path(tmp) / "back", "f32")
                rows.append({"type": "gguf f32 -> hf f32", "seconds": round(back_seconds, 1),
                             "peak_rss_bytes": back_peak})
                print(json.dumps(rows[-1]), flush=True)
            if args.memory_only:
                rows.append({"type": kind, "bytes": out.stat().st_size, "seconds": round(seconds, 1),
                             "peak_rss_bytes": peak})
                print(json.dumps(rows[-1]), flush=True)
                out.unlink()
                continue
            logits = teacher_forced_logits(out, ids)
            if baseline is None:
                baseline = logits
            ref_logp, logp = log_softmax(baseline), log_softmax(logits)
            row = {"type": kind, "bytes": out.stat().st_size, "seconds": round(seconds, 1),
                   "peak_rss_bytes": peak,
                   "logits_rel_rms": float(np.sqrt(np.mean((logits - baseline) ** 2) / np.mean(baseline ** 2))),
                   "kl_nats": float(np.mean(np.sum(np.exp(ref_logp) * (ref_logp - logp), axis=-1))),
                   "top1_agree": float(np.mean(logits.argmax(-1) == baseline.argmax(-1)))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({"tokens": len(ids), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
