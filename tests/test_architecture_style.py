"""Every family writes a layer one way: ``Block.forward``, read straight down.

Graph capture is the engine's (``infer/engine/capture.py`` records the whole
step), so architecture code keeps no pieces cut out for a compiler: no block
or layer object carries ``first``/``before``/``after`` functions, and no
family runs the decoder's layers one call per layer (the old ``run_layers(h,
[layer], ctx)``). ``Decoder.forward`` is the one loop over a decoder's layers;
hybrids branch on the layer's kind inside it (docs/architectures.md, "How the
families share code").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from reference import load_tiny

import infer.architectures
from infer.architectures.decoder import Block, Decoder, DecoderLayer

ARCHITECTURES = Path(infer.architectures.__file__).parent
CAPTURE_PIECES = ("first", "before", "after")
#: One tiny model per family whose layers go through the decoder's Block (tests/reference.py).
FAMILIES = ("llama3", "gemma3", "gpt2", "olmo2", "granite", "deepseek_v3", "gpt_oss", "lfm2", "granitemoehybrid",
            "falcon_h1", "qwen3_5", "qwen3_next")


def _modules() -> list[tuple[str, ast.Module]]:
    return [(path.name, ast.parse(path.read_text(), str(path))) for path in sorted(ARCHITECTURES.glob("*.py"))]


def test_no_architecture_module_defines_capture_pieces() -> None:
    found = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in CAPTURE_PIECES:
                found.append(f"{name}:{node.lineno} def {node.name}")
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in CAPTURE_PIECES:
                    found.append(f"{name}:{node.lineno} .{target.attr} =")
    assert not found, f"capture pieces in architecture code: {found}"


def test_no_family_runs_layers_one_call_per_layer() -> None:
    """``run_layers`` is gone, and only ``Decoder.forward`` loops over ``Block.forward``."""
    assert not hasattr(Decoder, "run_layers")
    found = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "run_layers":
                found.append(f"{name}:{node.lineno} run_layers")
            if isinstance(node, ast.For) and name != "decoder.py":
                for call in ast.walk(node):
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                            and call.func.attr == "forward" and "block" in ast.unparse(call.func.value)):
                        found.append(f"{name}:{call.lineno} {ast.unparse(call.func)} in a loop")
    assert not found, f"layers run outside Decoder.forward's one loop: {found}"


@pytest.mark.parametrize("variant", FAMILIES)
def test_layers_and_blocks_carry_no_capture_pieces(variant: str) -> None:
    network = load_tiny(variant).network
    assert isinstance(network, Decoder) and type(network).forward is Decoder.forward, \
        f"{variant}: its layers run through Decoder.forward's one loop"
    for layer in network.layers:
        assert isinstance(layer, DecoderLayer) and isinstance(layer.block, Block)
        for obj in (layer, layer.block):
            assert not [p for p in CAPTURE_PIECES if hasattr(obj, p)], f"{variant}: {type(obj).__name__}"


def test_old_weight_split_names_still_read_with_a_warning() -> None:
    """A plugin written against 0.1 read ``layer.attn_in`` / ``attn_out``; they
    now name the one weights dict, with a DeprecationWarning."""
    layer = load_tiny(FAMILIES[0]).network.layers[0]
    for name in ("attn_in", "attn_out"):
        with pytest.warns(DeprecationWarning, match=f"DecoderLayer.{name}"):
            assert getattr(layer, name) is layer.weights
