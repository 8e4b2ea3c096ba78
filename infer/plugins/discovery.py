"""The plugin manager: discovers plugins once per process.

Plugins are published under the ``infer`` entry-point group. They are loaded
one at a time: a plugin that fails to import, or whose hook raises, is
recorded in :attr:`Registry.failures` with its reason and logged, never
fatal, whatever it raises (``SystemExit`` and ``KeyboardInterrupt`` from a
plugin included: a plugin must not end the process that imports infer).
Setting ``INFER_PLUGINS`` to a comma-separated list of entry-point names loads
only those third-party plugins (the escape hatch when one breaks the
process); infer's own first-party plugins always load, since without them
nothing works. ``INFER_PLUGINS=""`` (set but empty) loads no third-party
plugin.

First-party names are protected: infer's own plugins register first, and a
third-party plugin that registers a backend, architecture, ``model_type`` or
format one of them already holds is refused and recorded as the failure. A
third-party plugin named in ``INFER_PLUGINS`` has opted in to replacing them
(logged as a warning).

infer's own architecture modules are not imported at discovery: a stand-in
registers the specs :mod:`infer.plugins.architecture_index` lists for each, and the
module is imported when one of its specs builds a model.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pluggy

from infer.plugins import hookspecs
from infer.plugins.registry import (  # noqa: F401 - distribution_version re-exported
    PluginFailure,
    Registry,
    _path_distributions,
    _read,
    distribution_version,
)

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "infer"
ALLOW_LIST_ENV = "INFER_PLUGINS"
_FIRST_PARTY_PREFIX = "infer."

_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None
_load_failures: list[PluginFailure] = []


def _allowed(name: str, value: str) -> bool:
    if value.startswith(_FIRST_PARTY_PREFIX):
        return True
    allow = os.environ.get(ALLOW_LIST_ENV)
    if allow is None:
        return True
    return name in {item.strip() for item in allow.split(",") if item.strip()}


def _opted_in(name: str) -> bool:
    """Whether ``INFER_PLUGINS`` names the third-party plugin ``name`` explicitly."""
    allow = os.environ.get(ALLOW_LIST_ENV)
    return allow is not None and name in {item.strip() for item in allow.split(",")}


def _first_party(plugin: object) -> bool:
    return getattr(plugin, "__name__", "").startswith(_FIRST_PARTY_PREFIX)


def _stand_in(value: str) -> object | None:
    """What registers in place of a first-party architecture module without importing it
    (:mod:`infer.plugins.architecture_index`), or None: the entry point is loaded."""
    if not value.startswith("infer.architectures."):
        return None
    from infer.plugins import architecture_index as index

    return index.stand_in(value)


class _Hooks:
    """A first-party module's hook implementations alone, registered in its place."""

    def __init__(self, module: ModuleType) -> None:
        self.__name__ = module.__name__
        marker = f"{hookspecs.hookimpl.project_name}_impl"
        self._hooks = [name for name, value in vars(module).items() if getattr(value, marker, None) is not None]
        for name in self._hooks:
            setattr(self, name, getattr(module, name))

    def __dir__(self) -> list[str]:  # what pluggy looks through: the hooks, not object's attributes
        return self._hooks


def _hooks_only(plugin: object) -> object:
    """What to register for a loaded plugin: pluggy reads every attribute of what it
    registers (``inspect.getattr_static``: about a thousand attributes over infer's own
    plugin modules, several ms of every load), so infer's modules are registered as
    their hook implementations alone; anything else as it is."""
    if isinstance(plugin, ModuleType) and _first_party(plugin):
        return _Hooks(plugin)
    return plugin


class _EntryPoint:
    """An entry point found by :func:`entry_points`: ``name = module[:attribute]``."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value

    def load(self) -> Any:
        """The object the value names (``importlib.metadata.EntryPoint.load``'s rule)."""
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(f"entry point value {self.value!r} is not 'module' or 'module:attribute'")
        target = importlib.import_module(match["module"])
        for attribute in filter(None, (match["attr"] or "").split(".")):
            target = getattr(target, attribute)
        return target


_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


def entry_points(group: str) -> list[Any]:
    """The entry points of ``group``, as ``importlib.metadata.entry_points(group=group)``
    lists them (each with ``name``, ``value`` and ``load()``).

    Importing ``importlib.metadata`` (email, zipfile, csv...) took 15-35 ms of every
    process that loads a model, more than the rest of discovery. Where the
    distributions are what the path finder alone lists, ``*.dist-info`` and
    ``*.egg-info`` folders in the folders of ``sys.path``, they are read here instead,
    in its order and keeping the first distribution of each name, as it does; anything
    else (a zip or an egg on the path, another finder listing distributions) is left to
    ``importlib.metadata``. tests/test_plugins.py compares the two.
    """
    distributions = _path_distributions()
    if distributions is None:
        import importlib.metadata

        return list(importlib.metadata.entry_points(group=group))
    found = []
    for folder in distributions.values():
        text = _read(folder, "entry_points.txt")
        found += [_EntryPoint(name, value) for g, name, value in _sections(text or "") if g == group]
    return found


def _sections(text: str) -> Iterator[tuple[str, str, str]]:
    """(group, name, value) of each ``name = value`` line of an ``entry_points.txt``."""
    group = None
    for line in map(str.strip, text.splitlines()):
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            group = line.strip("[]")
        elif group is not None and "=" in line:  # (importlib.metadata raises on a line without one)
            name, _, value = line.partition("=")
            yield group, name.strip(), value.strip()


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    seen: dict[str, str] = {}
    for ep in entry_points(ENTRY_POINT_GROUP):
        if ep.name in seen:
            if seen[ep.name] != ep.value:  # two plugins under one name: neither may hide the other silently
                reason = f"entry point name {ep.name!r} is already taken by {seen[ep.name]}"
                _load_failures.append(PluginFailure(ep.name, ep.value, reason))
                log.warning("plugin %s (%s) not loaded: %s", ep.name, ep.value, reason)
            continue  # (the same distribution visible twice, e.g. editable + wheel, is fine)
        seen[ep.name] = ep.value
        if not _allowed(ep.name, ep.value):
            log.info("plugin %s (%s) skipped: not in %s", ep.name, ep.value, ALLOW_LIST_ENV)
            continue
        try:
            plugin = _stand_in(ep.value) or _hooks_only(ep.load())
        except BaseException as exc:  # noqa: BLE001 - any import-time failure, sys.exit() included, is reported
            reason = f"{type(exc).__name__}: {exc}"
            _load_failures.append(PluginFailure(ep.name, ep.value, reason))
            log.warning("plugin %s (%s) failed to load: %s", ep.name, ep.value, reason)
            continue
        pm.register(plugin, name=ep.name)
        log.debug("plugin %s loaded from %s", ep.name, ep.value)


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, with entry points loaded."""
    global _manager
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager("infer")
            pm.add_hookspecs(hookspecs)
            _load_entry_points(pm)
            _manager = pm
        return _manager


def _collect(registry: Registry, hook: Any, add: Any) -> None:
    # First-party plugins register first, so a name they hold is theirs (module docstring).
    for impl in sorted(hook.get_hookimpls(), key=lambda impl: not _first_party(impl.plugin)):
        replace = not _first_party(impl.plugin) and _opted_in(impl.plugin_name)

        def register(spec: Any, _plugin: str = impl.plugin_name, _replace: bool = replace) -> None:
            if dataclasses.is_dataclass(spec) and hasattr(spec, "plugin"):
                spec = dataclasses.replace(spec, plugin=_plugin)
            add(spec, replace=_replace)

        try:
            impl.function(register=register)
        except BaseException as exc:  # noqa: BLE001 - a broken hook is reported, never fatal (SystemExit too)
            reason = f"{type(exc).__name__}: {exc}"
            registry.failures.append(PluginFailure(impl.plugin_name, hook.name, reason))
            log.warning("plugin %s failed in %s: %s", impl.plugin_name, hook.name, reason)


def _check_hook_names(pm: pluggy.PluginManager, registry: Registry) -> None:
    """A misspelt hook (``infer_register_backend``) would never be called:
    record it instead of ignoring it."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = getattr(exc.plugin, "__name__", repr(exc.plugin))
        registry.failures.append(PluginFailure(name, "", f"unknown hook: {exc}"))
        log.warning("plugin %s: %s", name, exc)


def get_registry() -> Registry:
    """Everything the loaded plugins registered (built once, then cached)."""
    global _registry
    with _lock:
        if _registry is None:
            pm = plugin_manager()
            registry = Registry(failures=list(_load_failures))
            registry.first_party_plugins = {name for name, plugin in pm.list_name_plugin() if _first_party(plugin)}
            _collect(registry, pm.hook.infer_register_backends, registry.add_backend)
            _collect(registry, pm.hook.infer_register_architectures, registry.add_architecture)
            _collect(registry, pm.hook.infer_register_formats, registry.add_format)
            _check_hook_names(pm, registry)
            _registry = registry
        return _registry


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object or module at run time (tests, notebooks).

    Returns the name it was registered under; pass it to
    :func:`unregister_plugin` to remove it again.
    """
    global _registry
    with _lock:
        registered = plugin_manager().register(plugin, name=name)
        if registered is None:
            raise ValueError(f"plugin {name or plugin!r} is already registered")
        _registry = None
        return registered


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with :func:`register_plugin`."""
    global _registry
    with _lock:
        plugin_manager().unregister(name=name)
        _registry = None


def reload_plugins() -> None:
    """Forget everything and rediscover entry points (e.g. after changing
    ``INFER_PLUGINS``)."""
    global _manager, _registry
    with _lock:
        _manager = None
        _registry = None
        _load_failures.clear()
