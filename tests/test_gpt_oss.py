"""gpt-oss beyond the shared parity runner (tests/test_families.py runs ``gpt_oss`` and
``gpt_oss_top3`` against transformers float32): config.json as the released models write
it, and their MXFP4 expert weights.

* The released config.json is in the 4.x form (top-level ``rope_theta``, ``rope_scaling``
  with ``truncate`` false) and may call the expert count ``num_experts`` (transformers'
  ``attribute_map``); a folder rewritten so reads as the reference's logits.
* Continuous batching (ragged batches through the MoE, the sinks and the sliding layers'
  pages) gives each request its tokens alone, paged and contiguous, on numpy and torch.
* Harmony replies as gpt-oss writes them (infer.reasoning.HarmonyParser with the harmony
  tool parser): the recipient in the role part of the header, a commentary preamble
  before a call, a call without its closing ``<|call|>`` (a stop token), split the same
  wherever the stream cuts them.
* MXFP4 (formats/mxfp4.py): the dequantization equals transformers' own
  (``convert_moe_packed_tensors``, float32) code for code on random bytes, and a folder
  whose experts are stored as ``_blocks`` / ``_scales`` loads to the logits of the same
  folder with those weights stored dequantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from reference import assert_logits_close, encode, reference_logits, tiny_model_dir
from test_families import DECODE_TEXT, PROMPT

import infer
from infer.chat import ReplyParser
from infer.engine.batch import BatchEngine
from infer.engine.generate import StopConditions, generate
from infer.engine.sampling import SamplingParams
from infer.formats.mxfp4 import dequantize_mxfp4
from infer.reasoning import get_reasoning_parser
from infer.tool_parsers import get_tool_parser


def _logits(path: Path, ids: list[int], backend: str = "numpy") -> np.ndarray:
    model = infer.load(path, backend=backend)
    return model.backend.to_numpy(model.engine.forward(model.engine.new_sequence(), ids, all_logits=True))


def _copy(path: Path, out: Path) -> Path:
    shutil.copytree(path, out)
    return out


def test_the_released_config_form_reads_as_the_reference(tmp_path: Path) -> None:
    path = tiny_model_dir("gpt_oss")
    out = _copy(path, tmp_path / "legacy")
    config = json.loads((out / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope  # yarn, truncate false, as openai/gpt-oss-20b
    config["num_experts"] = config.pop("num_local_experts")
    (out / "config.json").write_text(json.dumps(config))
    ids = encode(path, PROMPT + DECODE_TEXT)
    assert_logits_close(_logits(out, ids), reference_logits(path, ids, [])["prefill"], "gpt_oss, 4.x config form")


def test_mxfp4_dequantization_matches_transformers() -> None:
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)  # [experts, rows, groups, 16]
    scales = rng.integers(120, 134, (3, 10, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    got = np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2)  # as the parameters hold them
    np.testing.assert_array_equal(got, want)


def _mxfp4(w: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks and scales for a parameter shaped like ``w`` ([experts, in, out]):
    blocks [experts, out, in / 32, 16], scales near 2**-3 (values of ~0.1 to 0.75)."""
    e, n_in, n_out = w.shape
    blocks = rng.integers(0, 256, (e, n_out, n_in // 32, 16), dtype=np.uint8)
    scales = rng.integers(122, 126, (e, n_out, n_in // 32), dtype=np.uint8)
    return blocks, scales


def test_an_mxfp4_folder_loads_as_its_dequantized_weights(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    path = tiny_model_dir("gpt_oss")  # hidden 64, intermediate 32: whole blocks of 32 both ways
    state = load_file(path / "model.safetensors")
    rng = np.random.default_rng(1)
    packed, dense = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(state[name], rng)
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dense[name] = np.ascontiguousarray(np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2))
        assert dense[name].shape == state[name].shape
    folders = {}
    for kind, tensors in (("mxfp4", packed), ("dense", dense)):
        out = _copy(path, tmp_path / kind)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        if kind == "mxfp4":
            config = json.loads((out / "config.json").read_text())
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
            (out / "config.json").write_text(json.dumps(config))
        folders[kind] = out
    ids = encode(path, PROMPT)
    want = _logits(folders["dense"], ids)
    assert np.abs(want - _logits(path, ids)).max() > 1e-2  # the new expert weights matter
    got = _logits(folders["mxfp4"], ids)
    np.testing.assert_array_equal(got, want)
    # transformers' own load of the MXFP4 folder (without triton it dequantizes, here to float32)
    torch = pytest.importorskip("torch")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folders["mxfp4"], dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert_logits_close(got, ref, "gpt_oss MXFP4 against transformers' dequantizing load")


PROMPTS = [list(range(3, 8)), list(range(20, 43)), [9], list(range(50, 63)), list(range(30, 34)) * 3]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("backend", ["numpy", "torch:cpu"])
def test_batched_greedy_equals_single_requests(backend: str, layout: str) -> None:
    if backend.startswith("torch"):
        pytest.importorskip("torch")
    engine = infer.load(tiny_model_dir("gpt_oss"), backend=backend).engine
    stop = StopConditions(max_tokens=10, ignore_eos=True)
    want = [list(generate(engine, p, SamplingParams(), stop)) for p in PROMPTS]
    if layout == "paged":
        batch = BatchEngine(engine, kv_pool=engine.new_kv_pool(block_size=4, num_blocks=64))
    else:
        batch = BatchEngine(engine, kv_layout="contiguous", kv_memory=256 * engine.kv_bytes_per_position())
    handles = [batch.submit(p, SamplingParams(), stop) for p in PROMPTS]
    batch.run_until_done()
    assert [h.tokens for h in handles] == want


TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
#: reply -> (reasoning, content, calls)
HARMONY_REPLIES = [
    ('<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary '
     'json<|message|>{"city": "Paris"}<|call|>', ("Need it.", "", [("get_weather", '{"city": "Paris"}')])),
    ('<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking the '
     'weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Rome"}<|call|>', ("Think.", "Checking the weather.", [("get_weather", '{"city": "Rome"}')])),
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
     ("", "", [("get_weather", '{"city": "Oslo"}')])),
    ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>",
     ("Hmm.", "Four.", [])),
]


@pytest.mark.parametrize(("reply", "want"), HARMONY_REPLIES)
def test_harmony_replies_split_into_reasoning_content_and_calls(reply: str, want: tuple) -> None:
    for cut in range(len(reply) + 1):
        reader = ReplyParser(get_reasoning_parser("harmony"), False, get_tool_parser("harmony", TOOLS))
        reader.feed(reply[:cut])
        reader.feed(reply[cut:])
        reader.finish()
        calls = [(c.name, c.arguments) for _, _, c in reader.calls]
        assert (reader.reasoning, reader.content, calls) == want, cut


@pytest.mark.parametrize("backend", ["numpy", "torch:cpu", "mlx:cpu"])
@pytest.mark.parametrize(("lo", "hi"), [(None, 1.5), (-1.5, 1.5), (-0.5, None)])
def test_clip_native_and_default_equal_numpy_clip(backend: str, lo: float | None, hi: float | None) -> None:
    """The clamped SwiGLU's op: each backend's own ``clip`` and the contract's default
    (built from ``concat`` and ``max``) select exactly numpy.clip's values."""
    from infer.ops import Backend
    from infer.plugins.selection import select_backend

    if backend != "numpy":
        pytest.importorskip(backend.split(":")[0])
    ops = select_backend(backend)
    x = (np.random.default_rng(0).standard_normal((5, 7)) * 3).astype(np.float32)
    want = np.clip(x, lo, hi)
    for got in (ops.clip(ops.from_numpy(x), lo, hi), Backend.clip(ops, ops.from_numpy(x), lo, hi)):
        np.testing.assert_array_equal(ops.to_numpy(got), want)
