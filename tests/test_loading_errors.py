"""Bad model packages fail at load with a typed error naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import infer
from infer.errors import (
    ConfigError,
    MissingTensorError,
    ModelNotFoundError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    UnsupportedFormatError,
)
from reference import tiny_model_dir


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama3"), dst)
    return dst


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_weights(folder: Path, fn) -> None:  # type: ignore[no-untyped-def]
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_the_untouched_copy_loads(folder: Path) -> None:
    assert infer.load(folder, backend="numpy").generate("Hello", max_tokens=2, ignore_eos=True)


def test_unknown_architecture_lists_the_supported_ones(folder: Path) -> None:
    edit_config(folder, model_type="frobnicator")
    with pytest.raises(UnsupportedArchitectureError, match="frobnicator.*llama") as raised:
        infer.load(folder, backend="numpy")
    for model_type in ("qwen3", "qwen3_moe", "mixtral", "phi3", "olmo2", "smollm3", "granite", "gpt2"):
        assert model_type in str(raised.value)


def test_missing_tensor_is_named(folder: Path) -> None:
    edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        infer.load(folder, backend="numpy")


def test_shape_mismatch_names_tensor_and_shapes(folder: Path) -> None:
    def shrink(t: dict[str, np.ndarray]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    edit_weights(folder, shrink)
    with pytest.raises(ShapeMismatchError, match=r"k_proj\.weight.*\[31, 64\].*\[32, 64\]"):
        infer.load(folder, backend="numpy")


def test_config_contradicting_the_weights(folder: Path) -> None:
    edit_config(folder, hidden_size=48)
    with pytest.raises(ShapeMismatchError, match="embed_tokens"):
        infer.load(folder, backend="numpy")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(hidden_size=None), "hidden_size"),
        (dict(num_attention_heads="four"), "num_attention_heads"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(hidden_act="swoosh"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "zigzag", "rope_theta": 1.0}), "zigzag"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1.0}), "factor"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": -5}), "rope_theta"),
    ],
)
def test_bad_config_values_are_config_errors(folder: Path, changes: dict, match: str) -> None:
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=match):
        infer.load(folder, backend="numpy")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        infer.load(tmp_path / "nowhere")


def test_file_of_no_known_format(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a model")
    with pytest.raises(UnsupportedFormatError, match="notes.txt"):
        infer.load(path)
