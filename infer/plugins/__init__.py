"""How infer finds and chooses its parts.

* :mod:`infer.plugins.hookspecs` — the hooks a plugin implements
  (``@hookimpl``), part of the contract plugins are written against;
* :mod:`infer.plugins.registry` — the specs a plugin registers
  (:class:`~infer.plugins.registry.BackendSpec`, ``ArchitectureSpec``,
  ``FormatSpec``) and the registry that holds them;
* :mod:`infer.plugins.discovery` — loading the ``infer`` entry points once per
  process, failures recorded, never fatal;
* :mod:`infer.plugins.selection` — choosing a backend for a request.

The discovery functions are re-exported here: ``infer.plugins.get_registry()``.
"""

from __future__ import annotations

from infer.plugins.discovery import (
    ALLOW_LIST_ENV,
    ENTRY_POINT_GROUP,
    get_registry,
    plugin_manager,
    register_plugin,
    reload_plugins,
    unregister_plugin,
)

__all__ = ["ALLOW_LIST_ENV", "ENTRY_POINT_GROUP", "get_registry", "plugin_manager", "register_plugin",
           "reload_plugins", "unregister_plugin"]
