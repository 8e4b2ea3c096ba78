"""``infer.convert``: rewrite a model in another format or storage type.

A source of any registered format is opened as a :class:`~infer.package.ModelPackage`
(the same normalized form :func:`infer.load` runs) and handed to the target format's
writer (``FormatSpec.write``): a ``.gguf`` output goes to the ``gguf`` format,
anything else becomes a Hugging Face folder. The writer works on a hidden sibling
of the output (``.NAME.partial-*``) that is renamed into place only once it is
complete, and removed on any error or interrupt, so the output path never holds
a truncated file.

>>> import infer
>>> infer.convert("model-folder", "model.Q4_K_M.gguf", type="q4_k_m")   # doctest: +SKIP
PosixPath('model.Q4_K_M.gguf')
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infer.errors import ConversionError, InferError, OutputExistsError, UnsupportedArchitectureError
from infer.loading import resolve
from infer.plugins import get_registry

log = logging.getLogger(__name__)


def target_format(out: str | os.PathLike[str]) -> str:
    """The format an output path asks for: ``gguf`` for ``*.gguf``, else ``huggingface``."""
    return "gguf" if Path(out).suffix.lower() == ".gguf" else "huggingface"


def convert(src: str | os.PathLike[str], out: str | os.PathLike[str], *, type: str | None = None,
            force: bool = False, progress: bool | None = None, base: str | os.PathLike[str] | None = None,
            mmproj: str | os.PathLike[str] | None = None) -> Path:
    """Convert the model ``src`` into ``out``.

    Args:
        src: a model folder, ``.gguf`` file or catalog alias (as :func:`infer.load`).
        out: ``*.gguf`` for a GGUF file; any other path for a Hugging Face folder.
        type: how the weights are stored. GGUF: ``f32 f16 bf16 q8_0 q4_0 q4_1 q5_0
            q5_1 q4_k q5_k q6_k q4_k_m q5_k_m`` (default ``f16``); a Hugging Face
            folder: ``f32 f16 bf16`` (default ``f32``). See docs/convert.md.
        force: replace ``out`` if it exists.
        progress: a progress bar on stderr; None shows one only on a terminal.
        base: for a PEFT LoRA folder ``src`` (written to ``OUT.gguf`` as a GGUF
            adapter, docs/adapters.md), the base model it adapts (default: the
            folder's ``base_model_name_or_path``): its architecture and heads.
        mmproj: for a vision-language ``src`` (Gemma 3, LLaVA, Idefics3 /
            SmolVLM, Qwen3.5) written as GGUF, where its vision tower and projector
            go: llama.cpp's mmproj file (default: ``mmproj-<out name>``
            beside ``out``, which holds the text model). docs/vision.md,
            "GGUF pairs".

    Returns:
        ``out``, complete.

    Raises:
        ConversionError: ``type`` is not one the target format writes, or writing
            failed (the message says why; nothing is left at ``out``).
        OutputExistsError: ``out`` exists and ``force`` is false.
        UnsupportedArchitectureError: the model's architecture has no form in the
            target format (the message lists those that do).
        InferError: the source cannot be read (as :func:`infer.load` raises).
    """
    out = Path(out).expanduser()
    from infer.adapters.peft import is_peft_folder

    if is_peft_folder(Path(src).expanduser()):
        return convert_adapter(src, out, base=base, force=force)
    registry = get_registry()
    target = registry.format_for(out, target_format(out))
    if target.write is None or not target.write_types:
        raise ConversionError(f"format {target.name!r} cannot be written")
    type = target.write_types[0] if type is None else str(type).lower()
    if type not in target.write_types:
        raise ConversionError(f"unknown --type {type!r} for a {target.name} output ({out}); "
                              f"choose one of: {', '.join(target.write_types)}")
    if not out.parent.is_dir():
        raise ConversionError(f"cannot write {out}: the folder {out.parent} does not exist")
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExistsError(f"{out} exists; pass force=True (--force) to replace it")
    path = resolve(src, progress=bool(progress))
    if out.exists() and out.resolve() == path.resolve():
        raise ConversionError(f"{out} is the source itself; write the conversion elsewhere")
    source = registry.format_for(path)
    log.info("converting %s (%s) to %s (%s, %s)", path, source.name, out, target.name, type)
    package = source.open(path)
    try:
        package.read_config = registry.architecture_for(package.model_type).read_config
    except UnsupportedArchitectureError:  # the writer names what it supports
        pass
    pair = _vision_pair(target, package, path)
    if pair is not None:
        projector = Path(mmproj).expanduser() if mmproj is not None else out.with_name("mmproj-" + out.name)
        if (projector.exists() or projector.is_symlink()) and not force:
            package.tensors.close()
            raise OutputExistsError(f"{projector} exists; pass force=True (--force) to replace it")
        return _write_pair(target, package, pair, out, projector, type, progress)
    elif mmproj is not None:
        package.tensors.close()
        raise ConversionError(f"mmproj= writes the vision side of a Gemma 3, LLaVA, Idefics3 / SmolVLM or Qwen3.5 "
                              f"model to GGUF; {path} ({package.model_type}) has none to write there")
    _write_files(package, [(out, lambda to: target.write(package, to, type=type, progress=progress))])
    return out


def _vision_pair(target: Any, package: Any, path: Path) -> Any:
    """(text package, write_projector) of a vision-language package the target format keeps in two
    files (``FormatSpec.split_pair``), else None; the package's preprocessor settings (image mean
    and std, sizes) read for the projector file."""
    from infer.image_processing import PROCESSOR_DEFAULTS, read_preprocessor_config

    pair = target.split_pair(package) if target.split_pair is not None else None
    if pair is not None:
        vision = package.config.get("vision_config") or {}
        if package.model_type in ("qwen3_5", "qwen3_5_moe"):  # Qwen2-VL's processor: OpenAI CLIP's mean and std
            from infer.image_processors.qwen2_vl import Qwen2VLImageProcessor

            q = Qwen2VLImageProcessor()
            defaults = {"image_mean": q.image_mean, "image_std": q.image_std,
                        "size": {"shortest_edge": q.min_pixels, "longest_edge": q.max_pixels}}
        else:
            kind = ("Gemma3ImageProcessor" if package.model_type == "gemma3" else "CLIPImageProcessor"
                    if vision.get("model_type") == "clip_vision_model" else "SiglipImageProcessor")
            defaults = PROCESSOR_DEFAULTS[kind]
        package.preprocessor = {**defaults, **read_preprocessor_config(path)}
    return pair


def _write_pair(target: Any, package: Any, pair: Any, out: Path, projector: Path, type: str,
                progress: bool | None) -> Path:
    """The text model to ``out`` (the GGUF writer) and the vision side to ``projector`` (an mmproj
    file), each through its own partial file; neither is left behind on an error."""
    text, write_projector = pair
    _write_files(package, [(out, lambda to: target.write(text, to, type=type, progress=progress)),
                           (projector, lambda to: write_projector(to, type=type))])
    log.info("wrote %s (the text model) and %s (its vision tower and projector)", out, projector)
    return out


def _write_files(package: Any, writes: list[tuple[Path, Callable[[Path], None]]]) -> None:
    """Each ``write(partial)`` into a partial file beside its output, then every partial moved to
    its output; on an error every partial is removed (an ``OSError`` becomes a
    :class:`ConversionError` naming the outputs). ``package``'s tensors are closed either way."""
    partials = [out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}") for out, _ in writes]
    try:
        for (_, write), partial in zip(writes, partials):
            write(partial)
        for (out, _), partial in zip(writes, partials):
            _replace(partial, out)
    except BaseException as exc:
        for partial in partials:
            _remove(partial)
        if isinstance(exc, OSError) and not isinstance(exc, InferError):
            names = " and ".join(str(out) for out, _ in writes)
            # One output: its partial was the only thing written, so nothing is left there.
            left = f"; nothing was left at {names}" if len(writes) == 1 else ""
            raise ConversionError(f"writing {names} failed: {exc}{left}") from exc
        raise
    finally:
        package.tensors.close()


def convert_adapter(src: str | os.PathLike[str], out: str | os.PathLike[str], *,
                    base: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Write the PEFT LoRA folder ``src`` as the GGUF adapter ``out`` (float32
    factors; rsLoRA, ``rank_pattern`` and ``alpha_pattern`` folded into
    ``lora_b`` so that llama.cpp's one ``alpha / r`` gives each module's scale)
    for the model ``base`` (default: the folder's ``base_model_name_or_path``).

    Raises:
        ConversionError: ``out`` is not ``*.gguf``, or no base model is known.
        OutputExistsError: ``out`` exists and ``force`` is false.
        AdapterError: the adapter cannot be read, or has no GGUF form.
    """
    from infer.adapters.gguf import write_gguf_adapter
    from infer.adapters.peft import read_peft

    out = Path(out).expanduser()
    if target_format(out) != "gguf":
        raise ConversionError(f"a LoRA adapter converts to a GGUF adapter: name the output *.gguf, not {out}")
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExistsError(f"{out} exists; pass force=True (--force) to replace it")
    adapter = read_peft(src)
    base = base if base is not None else adapter.base_model
    if not base:
        raise ConversionError(f"{src}: adapter_config.json names no base model; pass base= (--base) to say which "
                              f"model it adapts")
    registry = get_registry()
    path = resolve(base)
    package = registry.format_for(path).open(path)
    try:
        config = dict(package.config)
    finally:
        package.tensors.close()
    config.setdefault("model_type", package.model_type)
    partial = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        write_gguf_adapter(adapter, partial, package.model_type, config)
        _replace(partial, out)
    except BaseException:
        _remove(partial)
        raise
    return out


def _replace(partial: Path, out: Path) -> None:
    """Move the finished ``partial`` to ``out``, replacing what ``force`` allowed to be there."""
    if out.is_dir() and not out.is_symlink():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
        os.replace(partial, out)
        import shutil  # here, not at the top: infer imports this module on every load

        shutil.rmtree(old, ignore_errors=True)
    elif partial.is_dir() and (out.exists() or out.is_symlink()):
        out.unlink()
        os.replace(partial, out)
    else:
        os.replace(partial, out)


def _remove(partial: Path) -> None:
    try:
        if partial.is_dir():
            import shutil  # (see _replace)

            shutil.rmtree(partial)
        else:
            partial.unlink(missing_ok=True)
    except OSError as exc:  # the error being raised matters more; say where the leftover is
        log.warning("could not remove the partial output %s: %s", partial, exc)
