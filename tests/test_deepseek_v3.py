"""DeepSeek-V3 beyond the shared parity runner: paging of MLA-shaped caches, and MTP modules.

test_parity.py runs the two tiny variants (``deepseek_v3``: low-rank queries, YaRN,
4 expert groups of which 2 are eligible, interleaved rope; ``deepseek_v3_lite``: no
query compression, no group limit) through prefill/decode logits, greedy tokens and
cached == full against transformers float32, at reference.LOGIT_RTOL * max|logit|
(2.0e-5; measured up to 1.8e-6 relative; dropping the routing bias, the group limit, the routed scaling, the YaRN
softmax mscale or the rope layout each moves the logits by 4%-110%).

MTP modules: transformers drops them at load, so the reference here is written from
the published formulas (DeepSeek-V3 report section 2.2, with the concatenation order
of the released ``eh_proj`` weights and the post-final-norm hidden state, see
docs/mtp.md) in plain torch around transformers' own decoder layer for the block.
The checkpoint is a tiny random deepseek_v3 model with 5 layers saved by
transformers, whose last two layers become MTP blocks: config.json then says 3
layers and 2 MTP modules, and each module gets its ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm`` (module 1 also its own embedding and head, as
DeepSeek's release ships them; its head perturbed so that using the main one fails). Tolerance as for parity:
LOGIT_RTOL * max|logit| (float32 on both sides, different summation orders; measured ~2e-6 relative,
while the hidden-first concatenation, the pre-norm hidden state or module 1 using the
main head instead of its own move the logits by 150%, 50% and 27%). transformers' own
``MtpModel`` (which its DeepseekV3ForCausalLM does not use) agrees with the reference
at depth 0 (measured 3.5e-7 relative).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import (
    _BASE,
    _DEEPSEEK_V3,
    BOS_ID,
    EOS_ID,
    KIT_VERSION,
    _build_dir,
    _randomize,
    cache_root,
    encode,
    reference_logits,
    tiny_model_dir,
    tiny_tokenizer_json,
)
from test_parity import DECODE_TEXT, PROMPT, assert_logits_close

import infer
from infer.kv.attention import AttentionContext, SequenceSlice
from infer.kv.cache import ContiguousKVCache
from infer.kv.paged import PagedKVPool

MAIN_LAYERS, MTP_MODULES = 3, 2


# ----------------------------------------------------------------------------- paging


@pytest.mark.parametrize(("backend", "block_size"), [
    ("numpy", 1), ("numpy", 4),
    pytest.param("torch:cpu", 4, marks=pytest.mark.skipif(not importlib.util.find_spec("torch"), reason="no torch")),
    pytest.param("mlx:cpu", 4, marks=pytest.mark.skipif(not importlib.util.find_spec("mlx"), reason="no mlx")),
])
def test_paged_cache_matches_transformers(backend: str, block_size: int) -> None:
    # Keys are 24 wide (16 nope + 8 rope) and values 12: pages of an MLA-shaped cache, read by
    # numpy's and torch's native paged_attention and, on MLX, gathered for its attention op.
    path = tiny_model_dir("deepseek_v3")
    model = infer.load(path, backend=backend)
    prompt, decode = encode(path, PROMPT), encode(path, DECODE_TEXT)
    ref = reference_logits(path, prompt, decode)
    engine, ops = model.engine, model.backend
    pool = engine.new_kv_pool(block_size=block_size, num_blocks=64)
    seq = engine.new_sequence(kv_pool=pool)
    assert_logits_close(ops.to_numpy(engine.forward(seq, prompt, all_logits=True)), ref["prefill"], "paged prefill")
    for step, (token, want) in enumerate(zip(decode, ref["decode"])):
        assert_logits_close(ops.to_numpy(engine.forward(seq, [token])[-1]), want, f"paged decode {step}")
    engine.release(seq)
    assert pool.stats().used == 0


def test_kv_cache_layers_hold_keys_and_values_of_different_widths() -> None:
    model = infer.load(tiny_model_dir("deepseek_v3"), backend="numpy")
    seq = model.engine.new_sequence(8)
    model.engine.forward(seq, [5, 6, 7])
    k, v = seq.cache.read(0, 0, 3)
    assert model.backend.shape(k) == (3, 4, 24) and model.backend.shape(v) == (3, 4, 12)
    assert model.network.num_mtp_modules == 0 and model.network.num_cache_layers == 3


# ----------------------------------------------------------------------------- the MTP checkpoint


def _mtp_tensors(state: dict[str, Any], hidden: int, vocab: int, gen: Any) -> dict[str, Any]:
    """The MTP-only tensors of modules 0 and 1 (their blocks are already layers 3 and 4)."""
    import torch

    out = {}
    for d in range(MTP_MODULES):
        p = f"model.layers.{MAIN_LAYERS + d}."
        out[p + "enorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
        out[p + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
        out[p + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
        out[p + "shared_head.norm.weight"] = 4.0 * (1.0 + 0.1 * torch.randn(hidden, generator=gen))
    # DeepSeek's release repeats the embedding and head in each module; module 1's head here is
    # a perturbed copy, so the test sees which one is used.
    p = f"model.layers.{MAIN_LAYERS + 1}."
    out[p + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    head = state["lm_head.weight"]
    out[p + "shared_head.head.weight"] = head + 0.3 * torch.randn(head.shape, generator=gen) / hidden ** 0.5
    return out


def _build_mtp(out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.DeepseekV3Config(**{**_BASE, **_DEEPSEEK_V3, "num_hidden_layers": MAIN_LAYERS + MTP_MODULES})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model.save_pretrained(out, safe_serialization=True)
    state = load_file(out / "model.safetensors")
    state.update(_mtp_tensors(state, config.hidden_size, config.vocab_size, torch.Generator().manual_seed(2)))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=MAIN_LAYERS, num_nextn_predict_layers=MTP_MODULES)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tiny_tokenizer_json(config.vocab_size))


def mtp_model_dir() -> Path:
    return _build_dir(cache_root() / f"tiny-v{KIT_VERSION}" / "deepseek_v3_mtp", _build_mtp)


def qwen3_next_named_dir(tmp_path: Path) -> Path:
    """The same checkpoint with its (single-module) MTP tensors in Qwen3-Next's naming."""
    from safetensors.numpy import load_file, save_file

    src = mtp_model_dir()
    out = tmp_path / "qwen3_next_named"
    shutil.copytree(src, out)
    state = load_file(out / "model.safetensors")
    first, renamed = f"model.layers.{MAIN_LAYERS}.", {}
    for name, value in state.items():
        if name.startswith(f"model.layers.{MAIN_LAYERS + 1}."):
            continue  # one module: Qwen3-Next shares fc and norms, so a second module would not map 1:1
        if name.startswith(first):
            rest = name[len(first):]
            rest = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
                    "hnorm.weight": "pre_fc_norm_hidden.weight", "shared_head.norm.weight": "norm.weight"}.get(
                rest, f"layers.0.{rest}")
            name = "mtp." + rest
        renamed[name] = value
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    cfg["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg) + "\n")
    return out


# ----------------------------------------------------------------------------- the reference


def reference_mtp(ids: list[int], *, hidden_first: bool = False, pre_norm_hidden: bool = False) -> list[np.ndarray]:
    """MTP logits of every depth over the whole sequence, from the published formulas.

    Depth d at row position p (0 <= p < n - 1 - d) combines the hidden state h^d[p] with the
    embedding of token t[p + 1 + d] and predicts t[p + 2 + d]:
        h'      = eh_proj([RMSNorm_e(Emb(t[p+1+d])) ; RMSNorm_h(h^d[p])])
        h^{d+1} = TRM_d(h'[0..p])                   causal, rope positions 0..
        logits  = head_d(RMSNorm_shared_head(h^{d+1}[p]))
    h^0 is the main model's last hidden state after its final norm (the tensor its head reads).
    The two flags build the wrong variants an engine could ship, to show the test tells them apart.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = mtp_model_dir()
    state = load_file(folder / "model.safetensors")
    big = AutoModelForCausalLM.from_pretrained(  # layers 3, 4 are the MTP blocks
        str(folder), dtype=torch.float32, attn_implementation="eager", num_hidden_layers=MAIN_LAYERS + MTP_MODULES)
    eps = big.config.rms_norm_eps

    def rms(x: Any, w: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    with torch.no_grad():
        t = torch.tensor(ids)
        h = big.model.embed_tokens(t[None])
        rope = big.model.rotary_emb(h, torch.arange(len(ids))[None])
        mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1)[None, None]
        for layer in big.model.layers[:MAIN_LAYERS]:
            h = layer(h, attention_mask=mask, position_embeddings=rope)
        final = big.model.norm(h)
        hidden = (h if pre_norm_hidden else final)[0]
        out = []
        for d in range(MTP_MODULES):
            p = f"model.layers.{MAIN_LAYERS + d}."
            n = len(ids) - 1 - d
            embed = state.get(p + "embed_tokens.weight", state["model.embed_tokens.weight"])
            head = state.get(p + "shared_head.head.weight", state["lm_head.weight"])
            e = rms(embed[t[1 + d: 1 + d + n]], state[p + "enorm.weight"])
            hh = rms(hidden[:n], state[p + "hnorm.weight"])
            x = torch.cat([hh, e] if hidden_first else [e, hh], -1) @ state[p + "eh_proj.weight"].T
            cos, sin = (r[:, :n] for r in rope)
            hidden = big.model.layers[MAIN_LAYERS + d](x[None], attention_mask=mask[..., :n, :n],
                                                       position_embeddings=(cos, sin))[0]
            out.append((rms(hidden, state[p + "shared_head.norm.weight"]) @ head.T).numpy())
    return out


def test_transformers_mtp_layer_agrees_with_the_reference(mtp_ids: list[int], reference: list[np.ndarray]) -> None:
    # transformers >= 5.2x ships an MtpModel for its own speculative decoding (not used by
    # DeepseekV3ForCausalLM, which drops the MTP weights): a second, independent implementation
    # of depth 0. It chains post-norm states, so depth 1 is not compared (docs/mtp.md).
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    layers = pytest.importorskip("transformers.modeling_layers")
    if not hasattr(layers, "MtpModel"):
        pytest.skip("this transformers has no MtpModel")
    folder = mtp_model_dir()
    main = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    mtp = layers.MtpModel(main, 1).eval()
    state, prefix, weights = load_file(folder / "model.safetensors"), f"model.layers.{MAIN_LAYERS}.", {}
    for name, value in state.items():
        rest = name[len(prefix):] if name.startswith(prefix) else None
        if rest is None or rest.startswith(("embed_tokens", "shared_head.head")):
            continue
        if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
            weights["layers.0." + rest] = value
        elif rest == "shared_head.norm.weight":
            weights["layers.0.post_norm.weight"] = value
        else:
            weights["layers.0.mtp_block." + rest] = value
    experts = "layers.0.mtp_block.mlp.experts."  # transformers stacks the experts
    stack = lambda kind: torch.stack([weights.pop(f"{experts}{e}.{kind}.weight")  # noqa: E731
                                      for e in range(main.config.n_routed_experts)])
    weights[experts + "gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
    weights[experts + "down_proj"] = stack("down_proj")
    missing, unexpected = mtp.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "shared_head.weight"}  # tied to main's
    with torch.no_grad():
        ids = torch.tensor([mtp_ids])
        hidden = main(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        n = len(mtp_ids) - 1
        out = mtp.forward_layer(0, hidden[:, :n], torch.arange(1, n + 1)[None], None, input_ids=ids[:, 1:])
        logits = mtp._project_to_logits(out)[0].numpy()
    assert_logits_close(logits, reference[0], "transformers' MtpModel, depth 0")


# ----------------------------------------------------------------------------- infer's side


def infer_mtp(model: infer.Model, ids: list[int], *, chunks: list[int] | None = None,
              pool: PagedKVPool | None = None) -> list[np.ndarray]:
    """Every depth's logits over the sequence through the public interface: forward,
    then mtp_forward and mtp_compute_logits per depth, fed in ``chunks`` of rows (cached)."""
    net, ops = model.network, model.backend
    n = len(ids)
    cache = pool.new_sequence(n) if pool is not None else ContiguousKVCache(ops, net.num_cache_layers, n)
    hidden = net.forward(ops.from_numpy(np.asarray(ids, np.int32)), AttentionContext(ops, [SequenceSlice(cache, 0, n)]))
    cache.commit(ids)  # as the engine does after a forward; MTP rows then go to committed positions
    assert ops.shape(hidden) == (n, net.config.hidden_size)
    out = []
    for d in range(net.num_mtp_modules):
        rows = n - 1 - d
        logits, outs, start = [], [], 0
        for size in (chunks or [rows]):
            size = min(size, rows - start)
            if size <= 0:
                break
            c = AttentionContext(ops, [SequenceSlice(cache, start, size)])
            tokens = ops.from_numpy(np.asarray(ids[start + 1 + d: start + 1 + d + size], np.int32))
            h = net.mtp_forward(d, ops.slice(hidden, 0, start, start + size), tokens, c)
            logits.append(ops.to_numpy(net.mtp_compute_logits(d, h)))
            outs.append(h)
            start += size
        assert start == rows
        hidden = outs[0] if len(outs) == 1 else ops.concat(outs, 0)
        out.append(np.concatenate(logits))
    cache.free()
    return out


@pytest.fixture(scope="module")
def mtp_ids() -> list[int]:
    return encode(tiny_model_dir("deepseek_v3"), PROMPT + DECODE_TEXT)


@pytest.fixture(scope="module")
def reference(mtp_ids: list[int]) -> list[np.ndarray]:
    return reference_mtp(mtp_ids)


def test_mtp_modules_are_read_from_the_checkpoint() -> None:
    model = infer.load(mtp_model_dir(), backend="numpy")
    assert model.network.num_mtp_modules == MTP_MODULES
    assert model.network.num_cache_layers == MAIN_LAYERS + MTP_MODULES
    # transformers' save_pretrained drops the MTP layers: such a checkpoint runs without them.
    assert infer.load(tiny_model_dir("deepseek_v3"), backend="numpy").network.num_mtp_modules == 0


def test_mtp_logits_match_the_reference(mtp_ids: list[int], reference: list[np.ndarray]) -> None:
    got = infer_mtp(infer.load(mtp_model_dir(), backend="numpy"), mtp_ids)
    for d, (g, want) in enumerate(zip(got, reference)):
        assert g.shape == want.shape
        assert_logits_close(g, want, f"MTP depth {d}")


def test_the_reference_tells_the_wrong_conventions_apart(mtp_ids: list[int], reference: list[np.ndarray]) -> None:
    # Swapping the concatenation or feeding the pre-norm hidden state moves every logit a lot.
    for wrong in (dict(hidden_first=True), dict(pre_norm_hidden=True)):
        other = reference_mtp(mtp_ids, **wrong)[0]
        rel = float(np.abs(other - reference[0]).max() / np.abs(reference[0]).max())
        assert rel > 0.05, f"{wrong}: only {rel:.3g} away"


@pytest.mark.parametrize("backend", ["numpy", "torch:cpu"])
def test_mtp_cached_in_chunks_and_paged(backend: str, mtp_ids: list[int], reference: list[np.ndarray]) -> None:
    # Rows fed 7, then 1 at a time: each module's own cache layer carries the earlier rows.
    model = infer.load(mtp_model_dir(), backend=backend)
    pool = model.engine.new_kv_pool(block_size=4, num_blocks=32)
    assert pool.num_layers == MAIN_LAYERS + MTP_MODULES
    chunks = [7] + [1] * len(mtp_ids)
    for got in (infer_mtp(model, mtp_ids, chunks=chunks), infer_mtp(model, mtp_ids, chunks=chunks, pool=pool)):
        for d, (g, want) in enumerate(zip(got, reference)):
            assert_logits_close(g, want, f"{backend} MTP depth {d}")
    assert pool.stats().used == 0


def test_engine_mtp_forward_gives_each_sequences_last_row(mtp_ids: list[int], reference: list[np.ndarray]) -> None:
    engine = infer.load(mtp_model_dir(), backend="numpy").engine
    net, ops = engine.model, engine.backend
    n = len(mtp_ids)
    seq = engine.new_sequence(n)
    out = engine.run(engine.prepare([seq], [mtp_ids], capture_hidden=True))  # the last row's logits only
    assert ops.shape(out.logits)[0] == 1 and ops.shape(out.hidden)[0] == n  # hidden: every row
    logits, h = engine.mtp_forward(0, [seq], [0], ops.slice(out.hidden, 0, 0, n - 1), [mtp_ids[1:]])
    assert ops.shape(logits)[0] == 1 and ops.shape(h) == (n - 1, net.config.hidden_size)
    assert_logits_close(ops.to_numpy(logits)[0], reference[0][-1], "last row")


def test_qwen3_next_naming_maps_onto_the_same_module(tmp_path: Path, mtp_ids: list[int],
                                                     reference: list[np.ndarray]) -> None:
    model = infer.load(qwen3_next_named_dir(tmp_path), backend="numpy")
    assert model.network.num_mtp_modules == 1
    got = infer_mtp(model, mtp_ids)
    assert_logits_close(got[0], reference[0], "Qwen3-Next-named MTP module")


def test_models_without_mtp_return_hidden_states_and_refuse_mtp_forward() -> None:
    for variant in ("llama3", "gemma3"):
        model = infer.load(tiny_model_dir(variant), backend="numpy")
        net, ops = model.network, model.backend
        assert net.num_mtp_modules == 0 and net.num_cache_layers == net.num_layers
        cache = ContiguousKVCache(ops, net.num_cache_layers, 4)
        ctx = AttentionContext(ops, [SequenceSlice(cache, 0, 4)])
        hidden = net.forward(ops.from_numpy(np.asarray([5, 6, 7, 8], np.int32)), ctx)
        assert ops.shape(hidden) == (4, net.config.hidden_size)
        assert ops.shape(net.compute_logits(hidden)) == (4, net.vocab_size)
        with pytest.raises(infer.errors.InferError):
            net.mtp_forward(0, hidden, ops.from_numpy(np.asarray([1, 2, 3, 4], np.int32)), ctx)
        with pytest.raises(infer.errors.InferError):
            net.mtp_compute_logits(0, hidden)
