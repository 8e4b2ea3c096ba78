"""What can be registered, and where registered things are found.

The plugin manager (:mod:`infer.plugins`) fills a :class:`Registry` from the
hooks in :mod:`infer.plugins.hookspecs`. This module holds the spec types and the
lookups; backend *selection* lives in :mod:`infer.plugins.selection`.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.errors import PluginError, UnsupportedArchitectureError, UnsupportedFormatError
from infer.ops import API_VERSION

if TYPE_CHECKING:
    from infer.ops import Backend, QuantizedTensor
    from infer.package import ModelPackage

log = logging.getLogger(__name__)

_OPT_IN = (" (first-party names are protected: name the plugin in INFER_PLUGINS to let it replace "
           "what it clashes with)")


@dataclass(frozen=True)
class Probe:
    """Whether a backend is usable here.

    ``score`` 0 means unusable, with ``reason`` saying why; higher scores are
    preferred when no backend is named (a GPU backend scores above a CPU one).
    """

    score: int
    reason: str | None = None
    #: Optional ops the backend would provide natively (for listings).
    native_ops: tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendSpec:
    """A backend family on one device, as registered by a plugin."""

    name: str
    device: str
    #: Builds the backend; receives the compute dtype (None: the default).
    factory: Callable[[str | None], Backend]
    #: Cheap, never raises: is this backend usable here?
    probe: Callable[[], Probe]
    description: str = ""
    api_version: tuple[int, int] = API_VERSION
    plugin: str = ""
    #: Optional: one line for ``infer doctor`` on how the backend is built here
    #: (e.g. which native kernels it has). Cheap, never raises.
    details: Callable[[], str] | None = None
    #: Optional: the highest score :attr:`probe` can return. Choosing a backend
    #: probes the specs best ceiling first and stops once one found outranks
    #: every ceiling left, so a backend that cannot win here (torch/cpu, 8,
    #: beside numpy, 10) is never probed, and its framework never imported, by
    #: a plain ``infer.load``. None: unknown, always probed.
    score_ceiling: int | None = None

    @property
    def key(self) -> str:
        return f"{self.name}/{self.device}"


@dataclass(frozen=True)
class ArchitectureSpec:
    """An architecture: which ``model_type`` values it builds, and how."""

    name: str
    model_types: tuple[str, ...]
    #: ``build(config_dict, weights, backend) -> CausalLM``.
    build: Callable[..., Any]
    description: str = ""
    plugin: str = ""
    #: ``read_config(config_dict) -> config object``: the architecture's own reading of a
    #: ``config.json`` (defaults, nulls and ``"auto"`` sizes resolved as transformers
    #: resolves them), for converters that need the resolved sizes without importing
    #: architecture code (:attr:`infer.package.ModelPackage.read_config`). None: not offered.
    read_config: Callable[[dict[str, Any]], Any] | None = None


@dataclass(frozen=True)
class FormatSpec:
    """A model format: a cheap ``detect`` and an ``open`` that normalizes."""

    name: str
    detect: Callable[[Path], bool]
    open: Callable[..., ModelPackage]
    description: str = ""
    plugin: str = ""
    #: Optional, for the conformance kit: ``random_tensor(qtype, shape, seed)``,
    #: a random but finite matrix stored in the format's quantized type
    #: ``qtype`` (a :class:`~infer.ops.QuantizedTensor`), the same for the same
    #: seed; None for a format without quantized types.
    random_tensor: Callable[[str, tuple[int, int], int], QuantizedTensor] | None = None
    #: Optional, for ``infer convert``: ``write(package, path, *, type, progress)`` writes a
    #: :class:`~infer.package.ModelPackage` in this format at ``path`` (which does not exist
    #: yet: the caller renames it into place afterwards). ``write_types`` names the storage
    #: types ``type`` accepts, the default first.
    write: Callable[..., None] | None = None
    write_types: tuple[str, ...] = ()
    #: Optional, for LoRA adapters stored in this format (docs/adapters.md):
    #: ``read_adapter(path, config)`` -> ``(model_type, {hf module: (a [r, in], b [out, r],
    #: scale)})`` (``config``: the base model's config.json, for layouts that need it), and
    #: ``write_adapter(path, model_type, modules, config, *, alpha=None)`` writes them.
    read_adapter: Callable[..., Any] | None = None
    write_adapter: Callable[..., None] | None = None
    #: Optional, for vision-language models kept in two files (llama.cpp's text GGUF and
    #: its ``mmproj`` GGUF; docs/vision.md, "GGUF pairs"): ``open_pair(model, projector)``
    #: opens the two as one :class:`~infer.package.ModelPackage`, and
    #: ``split_pair(package)`` gives ``(text package, write_projector)`` for a package whose
    #: vision side goes to a file of its own (``write_projector(path, *, type)``), or None.
    open_pair: Callable[..., ModelPackage] | None = None
    split_pair: Callable[..., Any] | None = None


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    name: str
    value: str
    reason: str


@dataclass
class Registry:
    """Everything registered in this process."""

    backends: dict[str, BackendSpec] = field(default_factory=dict)
    architectures: dict[str, ArchitectureSpec] = field(default_factory=dict)
    formats: dict[str, FormatSpec] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    #: Names of infer's own plugins (``infer.*`` modules), which hold their names first.
    first_party_plugins: set[str] = field(default_factory=set)

    # -- registration (called through the hooks' ``register`` callbacks) --

    def add_backend(self, spec: BackendSpec, replace: bool = False) -> None:
        """Add ``spec``; with ``replace`` it may take the place of one of the same key."""
        if not isinstance(spec, BackendSpec):
            raise PluginError(f"plugin {spec!r} registered a backend that is not a BackendSpec")
        if spec.api_version[0] != API_VERSION[0]:
            raise PluginError(
                f"backend {spec.key} was written for op contract {spec.api_version}, "
                f"infer implements {API_VERSION}: the major versions differ"
            )
        if spec.key in self.backends and replace:
            log.warning("backend %s of plugin %r replaces the one of %r (opted in through INFER_PLUGINS)",
                        spec.key, spec.plugin, self.backends[spec.key].plugin)
        elif spec.key in self.backends:
            raise PluginError(
                f"backend {spec.key} registered twice (by {self.backends[spec.key].plugin!r} "
                f"and {spec.plugin!r}); the second is refused{_OPT_IN}"
            )
        self.backends[spec.key] = spec

    def add_architecture(self, spec: ArchitectureSpec, replace: bool = False) -> None:
        """Add ``spec``; with ``replace`` it may take over a name or model types already held."""
        if not isinstance(spec, ArchitectureSpec):
            raise PluginError(f"plugin registered an architecture that is not an ArchitectureSpec: {spec!r}")
        if spec.name in self.architectures and not replace:
            raise PluginError(
                f"architecture {spec.name!r} registered twice (by {self.architectures[spec.name].plugin!r} "
                f"and {spec.plugin!r}); the second is refused{_OPT_IN}"
            )
        self.architectures.pop(spec.name, None)
        for other in list(self.architectures.values()):
            clash = set(other.model_types) & set(spec.model_types)
            if clash and not replace:
                raise PluginError(
                    f"architectures {other.name!r} ({other.plugin}) and {spec.name!r} ({spec.plugin}) "
                    f"both claim model_type {sorted(clash)}; the second is refused{_OPT_IN}"
                )
            if clash:
                log.warning("architecture %r of plugin %r takes model_type %s from %r (opted in through "
                            "INFER_PLUGINS)", spec.name, spec.plugin, sorted(clash), other.name)
                self.architectures[other.name] = dataclasses.replace(
                    other, model_types=tuple(t for t in other.model_types if t not in clash))
        self.architectures[spec.name] = spec

    def add_format(self, spec: FormatSpec, replace: bool = False) -> None:
        """Add ``spec``; with ``replace`` it may take the place of one of the same name."""
        if not isinstance(spec, FormatSpec):
            raise PluginError(f"plugin registered a format that is not a FormatSpec: {spec!r}")
        if spec.name in self.formats and not replace:
            raise PluginError(f"format {spec.name!r} registered twice (by {self.formats[spec.name].plugin!r} "
                              f"and {spec.plugin!r}); the second is refused{_OPT_IN}")
        self.formats[spec.name] = spec

    # -- lookups -----------------------------------------------------------

    def architecture_for(self, model_type: str) -> ArchitectureSpec:
        """The architecture implementing ``model_type``."""
        for spec in self.architectures.values():
            if model_type in spec.model_types:
                return spec
        supported = sorted(t for s in self.architectures.values() for t in s.model_types)
        raise UnsupportedArchitectureError(
            f"no architecture implements model_type {model_type!r}; supported: "
            f"{', '.join(supported) or 'none (no architecture plugin loaded)'}"
        )

    def format_for(self, path: Path, name: str | None = None) -> FormatSpec:
        """The format that can open ``path`` (or the one named)."""
        if name is not None:
            if name not in self.formats:
                raise UnsupportedFormatError(
                    f"unknown format {name!r}; registered: {', '.join(sorted(self.formats))}"
                )
            return self.formats[name]
        claims = []
        for spec in self.formats.values():
            try:
                claimed = spec.detect(path)
            except BaseException as exc:  # noqa: BLE001 - a broken detect() must not hide the others
                log.warning("format %s failed to inspect %s: %s: %s", spec.name, path, type(exc).__name__, exc)
                continue
            if claimed is True:  # a claim is True itself: a truthy object is no claim
                claims.append(spec)
            elif claimed is not False:
                log.warning("format %s: detect(%s) returned %r, not True or False; ignored", spec.name, path, claimed)
        if len(claims) > 1:
            # infer's own formats claim disjoint paths; a plugin that claims one of
            # them too loses to it, and two claims by plugins are the user's to settle.
            first_party = [c for c in claims if c.plugin in self.first_party_plugins]
            if len(first_party) == 1:
                log.warning("formats %s also claim %s; %s (first party) opens it (pass format= to choose)",
                            ", ".join(c.name for c in claims if c is not first_party[0]), path,
                            first_party[0].name)
                return first_party[0]
            raise UnsupportedFormatError(
                f"formats {', '.join(c.name for c in claims)} all claim {path}: pass format= "
                f"(one of them) to choose, or limit the plugins with INFER_PLUGINS"
            )
        if claims:
            return claims[0]
        raise UnsupportedFormatError(
            f"no registered format recognises {path}; registered formats: "
            f"{', '.join(sorted(self.formats)) or 'none'}"
        )


def parse_backend_name(text: str) -> tuple[str, str | None]:
    """``"torch"`` -> ("torch", None); ``"torch:cuda"``/``"torch/cuda"`` -> ("torch", "cuda")."""
    for sep in ("/", ":"):
        if sep in text:
            family, device = text.split(sep, 1)
            return family.strip().lower(), device.strip().lower() or None
    return text.strip().lower(), None


def gpu_driver_absent() -> str | None:
    """Why no CUDA or ROCm GPU can be here, found without importing a
    framework (importing torch only to report no device costs seconds and
    hundreds of MB: docs/performance.md, "Figures behind the code"), or None
    when only the framework can tell.

    On Linux a GPU needs its kernel driver's device node: ``/dev/nvidia*``
    (NVIDIA), ``/dev/kfd`` (ROCm) or ``/dev/dxg`` (WSL). Elsewhere: None.
    For backend probes (see :attr:`BackendSpec.score_ceiling` for the other
    half of keeping ``infer.load`` from importing what cannot win)."""
    import os
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        nodes = os.listdir("/dev")
    except OSError:
        return None
    if any(n.startswith("nvidia") or n in ("kfd", "dxg") for n in nodes):
        return None
    return "no GPU driver (no NVIDIA or ROCm device in /dev)"


def describe(items: Sequence[str]) -> str:
    return ", ".join(items) if items else "none"


# -- installed distributions, read as importlib.metadata reads them -----------------------------


def distribution_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``importlib.metadata.version``), or None
    where it is not installed; found as :func:`infer.plugins.discovery.entry_points` finds
    distributions, without importing ``importlib.metadata`` (15-35 ms) where the folders of
    ``sys.path`` are all it would read. Here, in the contract's module, so that a backend's
    probe may ask for its framework's version (docs/design.md, "Layering")."""
    distributions = _path_distributions()
    if distributions is not None:
        folder = distributions.get(_normalized(distribution))
        if folder is None:
            return None
        text = _read(folder, "METADATA") or _read(folder, "PKG-INFO") or ""  # importlib.metadata's order
        for line in text.splitlines():  # the headers, up to the first blank line
            if not line.strip():
                break
            if line.startswith("Version:"):
                return line[len("Version:"):].strip()
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _path_distributions() -> dict[str, str] | None:
    """Normalized name -> metadata folder of each distribution ``importlib.metadata`` reads
    (the first of each name, in its order), or None where the folders of ``sys.path`` are
    not all it reads."""
    path_finder = importlib.machinery.PathFinder
    if any(getattr(f, "find_distributions", None) is not None and f is not path_finder for f in sys.meta_path):
        return None
    found: dict[str, str] = {}
    for entry in sys.path:
        if not isinstance(entry, str) or entry.endswith(".egg") or os.path.isfile(entry):
            return None
        for name, info in _distributions(entry):
            found.setdefault(name, os.path.join(entry, info))
    return found


def _read(folder: str, name: str) -> str | None:
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        return None


def _distributions(folder: str) -> list[tuple[str, str]]:
    """(normalized name, metadata folder) in ``folder``, grouped by name in the order each
    name first appears (importlib.metadata's ``Lookup``)."""
    try:
        children = os.listdir(folder or ".")
    except OSError:
        return []
    grouped: dict[str, list[str]] = {}
    for child in children:
        if child.lower().endswith((".dist-info", ".egg-info")):
            grouped.setdefault(_normalized(child.rpartition(".")[0].partition("-")[0]), []).append(child)
    return [(name, child) for name, same in grouped.items() for child in same]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().replace("-", "_")
