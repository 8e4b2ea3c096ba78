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

``--kernels`` instead times the recurrent ops' C kernels against the numpy
code they replaced, interleaved in one process (:func:`run_kernels_ab`):

    python benchmarks/hybrid.py --family qwen3_5_0.7b --kernels --quantize q4 --prompt 128 --tokens 16

and ``--ops`` times the ops alone at those models' shapes (:func:`run_ops_ab`).
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
    # The shapes at full size: Qwen3.5 ~0.7B (24 layers, 3 gated-DeltaNet : 1 full attention,
    # Qwen3.5's vocabulary) and LFM2-1.2B (16 layers, 10 short-conv : 6 GQA).
    "qwen3_5_0.7b": ("Qwen3_5TextConfig", dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
        layer_types=["linear_attention"] * 3 + ["full_attention"], full_attention_interval=4)),
    "lfm2_1.2b": ("Lfm2Config", dict(
        hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
        conv_L_cache=3, vocab_size=65536, full_attn_idxs=[2, 5, 8, 10, 12, 14])),
}


def build(family: str, out: Path, dtype: str = "float32") -> None:
    import torch
    import transformers

    class_name, fields = FAMILIES[family]
    fields = dict(fields)
    layers = fields["num_hidden_layers"]
    if "layer_types" in fields:
        pattern = fields["layer_types"]
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    fields.setdefault("vocab_size", 32000)
    config = getattr(transformers, class_name)(max_position_embeddings=4096, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
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


def run_kernels_ab(path: Path, ids: list[int], tokens: int, repeats: int, quantize: str | None) -> dict[str, Any]:
    """The recurrent ops in C ("after") against what numpy ran before them
    ("before": gated DeltaNet's and the convolution's references row by row,
    Mamba2's numpy chunked scan), one model, the two runs interleaved in each
    repeat (the machine's load falls on both alike); medians."""
    import infer
    from infer.backends.cpu import kernels

    model = infer.load(path, backend="numpy", quantize=quantize)
    engine, built = model.engine, kernels.has_recurrent
    times: dict[str, dict[str, list[float]]] = {m: {"prefill": [], "decode": []} for m in ("before", "after")}

    def once(mode: str) -> None:
        kernels.has_recurrent = built if mode == "after" else (lambda: False)  # type: ignore[assignment]
        try:
            seq = engine.new_sequence(len(ids) + tokens + 1)
            start = time.perf_counter()
            token = int(np.argmax(engine.backend.to_numpy(engine.forward(seq, ids))[-1]))
            times[mode]["prefill"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(tokens):
                token = int(np.argmax(engine.backend.to_numpy(engine.forward(seq, [token]))[-1]))
            times[mode]["decode"].append(time.perf_counter() - start)
            engine.release(seq)
        finally:
            kernels.has_recurrent = built  # type: ignore[assignment]

    once("after")  # warm-up
    for _ in range(repeats):
        for mode in ("before", "after"):
            once(mode)
    out: dict[str, Any] = {"quantize": quantize, "simd": kernels.native.simd() if kernels.native else None}
    for mode, t in times.items():
        out[mode] = {"prefill_tok_s": len(ids) / statistics.median(t["prefill"]),
                     "decode_tok_s": tokens / statistics.median(t["decode"])}
    out["speedup_prefill"] = out["after"]["prefill_tok_s"] / out["before"]["prefill_tok_s"]
    out["speedup_decode"] = out["after"]["decode_tok_s"] / out["before"]["decode_tok_s"]
    return out


def run_ops_ab(rows: int, repeats: int) -> dict[str, Any]:
    """The recurrent ops alone at the models' shapes, C kernel against the
    numpy code it replaced (and the delta rule's chunked form against its
    recurrence), interleaved in each repeat; median milliseconds per call."""
    from infer import oplib
    from infer.backends.cpu import kernels, recurrent

    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    out: dict[str, Any] = {"simd": kernels.native.simd(), "rows": rows}
    for t in (rows, 1):
        qs, ckpt = np.array([0, t], np.int32), np.array([t - 1], np.int32)
        # Qwen3.5 0.7B's gated DeltaNet layer (16 heads of 128) and its convolution (6144 channels).
        q, k, v = f32(t, 16, 128), f32(t, 16, 128), f32(t, 16, 128)
        g, beta, s0 = -rng.random((t, 16)).astype(np.float32), rng.random((t, 16)).astype(np.float32), \
            np.zeros((1, 16, 128, 128), np.float32)
        x, win, w = f32(t, 6144), np.zeros((1, 3, 6144), np.float32), f32(6144, 4)
        # Granite 4.0-H-like Mamba2 mixer (32 heads of 64, state 128).
        xs, dt, B, C = f32(t, 32, 64), f32(t, 32), f32(t, 1, 128), f32(t, 1, 128)
        A, D, bias, h0 = -rng.random(32).astype(np.float32), f32(32), f32(32), np.zeros((1, 32, 64, 128), np.float32)
        # LFM2-1.2B's short convolution (2048 channels, 3 taps).
        xl, winl, wl = f32(t, 2048), np.zeros((1, 2, 2048), np.float32), f32(2048, 3)
        cases = {
            "gated_delta_rule": (lambda: oplib.gated_delta_rule_reference(q, k, v, g, beta, s0, qs, ckpt),
                                 lambda: kernels.gated_delta_rule(q, k, v, g, beta, s0, qs, ckpt, 128 ** -0.5, True, 0)),
            "causal_conv1d qwen3_5": (lambda: oplib.conv1d_reference(x, win, w, None, qs, ckpt, "silu"),
                                      lambda: kernels.causal_conv1d(x, win, w, None, qs, ckpt, True)),
            "causal_conv1d lfm2": (lambda: oplib.conv1d_reference(xl, winl, wl, None, qs, ckpt),
                                   lambda: kernels.causal_conv1d(xl, winl, wl, None, qs, ckpt, False)),
            "ssd": (lambda: recurrent.ssd(xs, dt, A, B, C, D, bias, h0, qs, ckpt, dt_softplus=True, dt_min=0.0,
                                          dt_max=float("inf")),
                    lambda: kernels.ssd(xs, dt, A, B, C, D, bias, h0, qs, ckpt, True, 0.0, float("inf"))),
        }
        if t > 1:
            cases["gated_delta_rule chunked vs recurrence"] = (
                lambda: kernels.gated_delta_rule(q, k, v, g, beta, s0, qs, ckpt, 128 ** -0.5, True, 64),
                cases["gated_delta_rule"][1])
        for name, (before, after) in cases.items():
            times: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(repeats):
                for mode, fn in (("before", before), ("after", after)):
                    start = time.perf_counter()
                    fn()
                    times[mode].append(time.perf_counter() - start)
            b, a = (1000 * statistics.median(times[m]) for m in ("before", "after"))
            out[f"{name}, {t} row{'s' if t > 1 else ''}"] = {"before_ms": b, "after_ms": a, "speedup": b / a}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_5")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kernels", action="store_true",
                        help="time the recurrent ops' C kernels against the numpy they replaced (no transformers)")
    parser.add_argument("--quantize", choices=["q8", "q4"], help="with --kernels: quantize the weights on load")
    parser.add_argument("--ops", action="store_true",
                        help="time the recurrent ops alone (C kernels against the numpy they replaced)")
    args = parser.parse_args()
    ids = [int(t) for t in np.random.default_rng(0).integers(10, 32000, args.prompt)]
    if args.ops:
        text = json.dumps(run_ops_ab(args.prompt, args.repeats), indent=2)
        if args.out:
            args.out.write_text(text + "\n")
        print(text)
        return
    if args.kernels:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / args.family
            build(args.family, path, "bfloat16" if args.quantize else "float32")  # bfloat16: half the build's memory
            report = {"family": args.family, "config": FAMILIES[args.family][1], "prompt": args.prompt,
                      "tokens": args.tokens, "repeats": args.repeats,
                      "kernels": run_kernels_ab(path, ids, args.tokens, args.repeats, args.quantize)}
        text = json.dumps(report, indent=2)
        if args.out:
            args.out.write_text(text + "\n")
        print(text)
        return
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
