"""Hybrid models of a useful size on numpy, against transformers float32 in the same run.

A hybrid's speed is set by its shapes (hidden 1024, its mix of recurrent and
attention layers), not by what its weights say, so each family is built by
transformers from a config with random weights and saved as a Hugging Face
folder; infer loads that folder on numpy, transformers keeps its own copy in
float32 on the CPU. Each engine is timed on its own work only, with the
median of ``--repeats`` runs:

* prefill: one forward over a ``--prompt``-token prompt from an empty cache
  (infer: ``engine.forward``; transformers: ``model(ids, use_cache=True)``);
* decode: ``--tokens`` greedy tokens after that prompt, one forward each
  (infer: ``generate_tokens``'s decode loop, prefill excluded; transformers:
  a loop of one-token forwards over its cache, argmax on the logits).

It also reports the bytes each sequence keeps: the recurrent state of every
recurrent layer (one slot) and the keys and values per position of the
attention layers. Results go to ``--out`` as JSON.

    python benchmarks/hybrid.py --family qwen3_5 --out benchmarks/results/hybrid-qwen3_5.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

#: config class, config fields: each about 0.2-0.4B parameters with hidden 1024.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3.5-0.8B's layout at hidden 1024: 3 gated-DeltaNet layers to 1 full-attention layer.
    "qwen3_5": ("Qwen3_5TextConfig", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4)),
    # Granite 4.0-H-like: Mamba2 mixers with attention every 4th layer, dense MLP.
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        hidden_size=1024, intermediate_size=2816, shared_intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=0, mamba_n_heads=32, mamba_d_head=64,
        mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, position_embedding_type="nope",
        layer_types=["mamba"] * 3 + ["attention"])),
    # LFM2-350M-like: short convolutions with attention on a few layers.
    "lfm2": ("Lfm2Config", dict(
        hidden_size=1024, intermediate_size=4608, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=8, block_auto_adjust_ff_dim=False, full_attn_idxs=[2, 5, 8, 10])),
}


def build(family: str, out: Path) -> None:
    import torch
    import transformers

    class_name, fields = FAMILIES[family]
    fields = dict(fields)
    layers = fields["num_hidden_layers"]
    if "layer_types" in fields:
        pattern = fields["layer_types"]
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    config = getattr(transformers, class_name)(vocab_size=32000, max_position_embeddings=4096, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(out, safe_serialization=True)


def median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_infer(path: Path, ids: list[int], tokens: int, repeats: int) -> dict[str, Any]:
    import infer

    model = infer.load(path, backend="numpy")
    engine = model.engine

    def prefill() -> None:
        seq = engine.new_sequence(len(ids) + tokens + 1)
        engine.forward(seq, ids)
        engine.release(seq)

    def decode() -> None:  # prefill, then the timed decode loop
        seq = engine.new_sequence(len(ids) + tokens + 1)
        logits = engine.backend.to_numpy(engine.forward(seq, ids))
        token = int(np.argmax(logits[-1]))
        start = time.perf_counter()
        for _ in range(tokens):
            token = int(np.argmax(engine.backend.to_numpy(engine.forward(seq, [token]))[-1]))
        decode.seconds.append(time.perf_counter() - start)  # type: ignore[attr-defined]
        engine.release(seq)

    decode.seconds = []  # type: ignore[attr-defined]
    prefill()  # warm-up
    t_prefill = median_time(prefill, repeats)
    for _ in range(repeats):
        decode()
    store = engine.state_store
    return {"prefill_tok_s": len(ids) / t_prefill,
            "decode_tok_s": tokens / statistics.median(decode.seconds),  # type: ignore[attr-defined]
            "state_bytes_per_sequence": 0 if store is None else store.nbytes_per_slot,
            "kv_bytes_per_position": engine.kv_bytes_per_position(),
            "recurrent_layers": 0 if store is None else len(store.specs),
            "layers": model.network.num_layers}


def run_transformers(path: Path, ids: list[int], tokens: int, repeats: int) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])

    @torch.no_grad()
    def prefill() -> Any:
        return model(x, use_cache=True)

    seconds = []

    @torch.no_grad()
    def decode() -> None:
        out = prefill()
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        seconds.append(time.perf_counter() - start)

    prefill()
    t_prefill = median_time(prefill, repeats)
    for _ in range(repeats):
        decode()
    return {"prefill_tok_s": len(ids) / t_prefill, "decode_tok_s": tokens / statistics.median(seconds),
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_5")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ids = [int(t) for t in np.random.default_rng(0).integers(10, 32000, args.prompt)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / args.family
        build(args.family, path)
        report = {"family": args.family, "config": FAMILIES[args.family][1], "prompt": args.prompt,
                  "tokens": args.tokens, "repeats": args.repeats,
                  "infer_numpy": run_infer(path, ids, args.tokens, args.repeats),
                  "transformers_float32": run_transformers(path, ids, args.tokens, args.repeats)}
    i, t = report["infer_numpy"], report["transformers_float32"]
    report["ratio_prefill"] = i["prefill_tok_s"] / t["prefill_tok_s"]
    report["ratio_decode"] = i["decode_tok_s"] / t["decode_tok_s"]
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
