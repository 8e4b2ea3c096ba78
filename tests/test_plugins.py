"""Plugins: registering backends, architectures and formats; broken plugins; selection.

Every test that registers something does it through the ``plugin`` fixture, which
unregisters it again however the test ends; tests that rediscover entry points go
through ``rediscover``, which leaves a freshly discovered registry behind.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from infer.backends.numpy import NumpyBackend

import infer
from infer.errors import BackendError, BackendUnavailableError, PluginError
from infer.ops import API_VERSION
from infer.plugins import get_registry, register_plugin, reload_plugins, unregister_plugin
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import ArchitectureSpec, BackendSpec, FormatSpec, Probe, Registry
from infer.plugins.selection import BACKEND_ENV, select_backend


class TestBackend(NumpyBackend):
    """The numpy backend under another name, so selection can tell them apart."""

    __test__ = False  # not a pytest test class
    name = "testbk"


def backend_spec(name="testbk", device="cpu", score=5, reason=None, probe=None, **kw) -> BackendSpec:
    return BackendSpec(
        name=name, device=device, factory=lambda dtype: TestBackend(dtype),
        probe=probe or (lambda: Probe(score, reason)), description="test backend", **kw,
    )


class BackendPlugin:
    """A plugin object registering the given specs, as a third-party module would."""

    def __init__(self, *specs) -> None:
        self.specs = specs

    @hookimpl
    def infer_register_backends(self, register):
        for spec in self.specs:
            register(spec)


class ArchitecturePlugin:
    def __init__(self, *specs) -> None:
        self.specs = specs

    @hookimpl
    def infer_register_architectures(self, register):
        for spec in self.specs:
            register(spec)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No test sees the caller's INFER_BACKEND / INFER_PLUGINS."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("INFER_PLUGINS", raising=False)


def key(backend) -> str:  # type: ignore[no-untyped-def]
    return f"{backend.name}/{backend.device}"


def best_available() -> str:
    """The first-party backend with the highest score here (numpy, torch/cpu, mlx/cpu... by what is installed)."""
    return next(b.key for b in infer.list_backends() if b.available and b.plugin in ("numpy", "torch", "mlx"))


@pytest.fixture
def plugin():
    """``plugin(obj, name)`` registers ``obj``; everything is unregistered at teardown."""
    names: list[str] = []

    def register(obj: object, name: str) -> str:
        names.append(register_plugin(obj, name=name))
        return names[-1]

    yield register
    for name in reversed(names):
        unregister_plugin(name)  # a no-op when the test already removed it


@pytest.fixture
def rediscover():
    """Rediscover entry points now (``rediscover()``) and again after the test, once
    the environment and ``sys.path`` are restored (discovery is lazy, so the reload
    at teardown takes effect on the next registry lookup, after monkeypatch undoes)."""
    yield reload_plugins
    reload_plugins()


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """``third_party(dist, {ep_name: (module, source)})`` installs a fake distribution
    on ``sys.path``: a ``.dist-info`` with entry points in group ``infer``, and the
    modules they point to. Imported test modules are removed from ``sys.modules``."""
    modules: list[str] = []

    def install(dist: str, entry_points: dict[str, tuple[str, str]]) -> None:
        info = tmp_path / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = ["[infer]"] + [f"{ep} = {module}" for ep, (module, _) in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in entry_points.values():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            modules.append(module)

    monkeypatch.syspath_prepend(str(tmp_path))
    yield install
    for module in modules:
        sys.modules.pop(module, None)


def backend_keys() -> set[str]:
    return {b.key for b in infer.list_backends()}


def failure_reasons() -> str:
    return "\n".join(f"{f.name} {f.value} {f.reason}" for f in get_registry().failures)


# -- registering a backend at run time ---------------------------------------------


def test_registered_backend_is_listed_selectable_and_removed_again(plugin):
    name = plugin(BackendPlugin(backend_spec(score=7)), "testbk-plugin")
    info = {b.key: b for b in infer.list_backends()}["testbk/cpu"]
    assert (info.available, info.score, info.reason, info.plugin) == (True, 7, None, "testbk-plugin")
    backend = select_backend("testbk")
    assert isinstance(backend, TestBackend) and backend.name == "testbk"
    assert isinstance(select_backend("testbk:cpu"), TestBackend)
    unregister_plugin(name)
    assert "testbk/cpu" not in backend_keys()
    assert "numpy/cpu" in backend_keys()


def test_backends_are_listed_best_first_and_the_best_is_chosen(plugin):
    plugin(BackendPlugin(backend_spec(score=50)), "fast")
    assert infer.list_backends()[0].key == "testbk/cpu"
    assert isinstance(select_backend(), TestBackend)


def test_a_backend_that_cannot_outrank_the_best_found_is_not_probed(plugin):
    # What keeps a plain infer.load from importing torch (2 s, 200 MB) to learn
    # that torch/cpu (ceiling 8) loses to numpy (10): probes run best ceiling first.
    probed: list[str] = []

    def probe(name, score):
        return lambda: probed.append(name) or Probe(score)

    plugin(BackendPlugin(backend_spec("slowbk", score=4, score_ceiling=4, probe=probe("slowbk", 4)),
                         backend_spec("fastbk", score=60, score_ceiling=60, probe=probe("fastbk", 60)),
                         backend_spec("gonebk", score=0, score_ceiling=90, probe=probe("gonebk", 0))), "ceilings")
    backend = select_backend()
    assert backend.name == "testbk" and probed == ["gonebk", "fastbk"]  # an unavailable one does not stop the search
    probed.clear()
    assert [b.key for b in infer.list_backends()][0] == "fastbk/cpu" and sorted(probed) == ["fastbk", "gonebk", "slowbk"]
    probed.clear()
    select_backend("slowbk")  # asked for by name, it is probed
    assert probed == ["slowbk"]


def test_a_spec_without_a_ceiling_is_always_probed(plugin):
    probed: list[str] = []
    plugin(BackendPlugin(backend_spec("plainbk", score=3, probe=lambda: probed.append("plainbk") or Probe(3))), "plain")
    chosen = key(select_backend())
    assert probed == ["plainbk"] and chosen == best_available()


def test_choosing_the_cpu_default_imports_no_gpu_framework_without_a_gpu_driver():
    from infer.plugins.registry import gpu_driver_absent

    if gpu_driver_absent() is None:
        pytest.skip("this machine has a GPU driver: torch must be imported to ask it")
    code = ("import sys; from infer.plugins.selection import select_backend; b = select_backend(); "
            "print(b.name, 'torch' in sys.modules, 'jax' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != BACKEND_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["numpy", "False", "False"]


def test_unavailable_backend_is_listed_with_its_reason(plugin):
    plugin(BackendPlugin(backend_spec(score=0, reason="no device")), "nodevice")
    info = {b.key: b for b in infer.list_backends()}["testbk/cpu"]
    assert not info.available and info.reason == "no device"
    with pytest.raises(BackendUnavailableError, match="no device"):
        select_backend("testbk")
    # Not asked for by name, it is simply passed over.
    assert not isinstance(select_backend(), TestBackend)
    assert key(select_backend()) == best_available()


def test_a_probe_that_raises_is_unavailable_not_fatal(plugin):
    def probe():
        raise RuntimeError("driver exploded")

    plugin(BackendPlugin(backend_spec(probe=probe)), "badprobe")
    info = {b.key: b for b in infer.list_backends()}["testbk/cpu"]
    assert not info.available
    assert "RuntimeError" in info.reason and "driver exploded" in info.reason
    with pytest.raises(BackendUnavailableError, match="driver exploded"):
        select_backend("testbk")
    assert key(select_backend()) == best_available()


def test_a_factory_that_fails_gives_backend_unavailable(plugin):
    def factory(dtype):
        raise ImportError("No module named 'fancyframework'")

    spec = BackendSpec(name="testbk", device="cpu", factory=factory, probe=lambda: Probe(5))
    plugin(BackendPlugin(spec), "badfactory")
    with pytest.raises(BackendUnavailableError, match="fancyframework"):
        select_backend("testbk")


# -- broken plugins ---------------------------------------------------------------------


def test_a_hook_that_raises_is_recorded_and_others_still_work(plugin):
    class Broken:
        @hookimpl
        def infer_register_backends(self, register):
            raise RuntimeError("boom in hook")

    plugin(Broken(), "broken-hook")
    plugin(BackendPlugin(backend_spec()), "healthy")
    failures = [f for f in get_registry().failures if f.name == "broken-hook"]
    assert len(failures) == 1
    assert failures[0].value == "infer_register_backends"
    assert "RuntimeError" in failures[0].reason and "boom in hook" in failures[0].reason
    assert {"testbk/cpu", "numpy/cpu"} <= backend_keys()
    assert "llama" in {a.name for a in infer.list_architectures()}


def test_registering_the_same_backend_twice_is_a_recorded_plugin_error(plugin):
    plugin(BackendPlugin(backend_spec(name="numpy", device="cpu")), "impostor")
    reasons = failure_reasons()
    assert "impostor" in reasons and "PluginError" in reasons and "numpy/cpu" in reasons
    assert "registered twice" in reasons
    # The first-party backend is the one kept.
    assert get_registry().backends["numpy/cpu"].plugin == "numpy"
    assert isinstance(select_backend("numpy"), NumpyBackend)


def test_registry_refuses_a_duplicate_backend_directly():
    registry = Registry()
    registry.add_backend(backend_spec())
    with pytest.raises(PluginError, match="registered twice"):
        registry.add_backend(backend_spec())


def test_a_backend_for_another_major_api_version_is_refused(plugin):
    newer = (API_VERSION[0] + 1, 0)
    plugin(BackendPlugin(backend_spec(api_version=newer)), "future")
    assert "testbk/cpu" not in backend_keys()
    reasons = failure_reasons()
    assert "future" in reasons and "PluginError" in reasons and "major" in reasons
    with pytest.raises(PluginError, match="major"):
        Registry().add_backend(backend_spec(api_version=newer))


def test_a_newer_minor_api_version_is_accepted(plugin):
    plugin(BackendPlugin(backend_spec(api_version=(API_VERSION[0], API_VERSION[1] + 1))), "minor")
    assert "testbk/cpu" in backend_keys()


def test_two_architectures_claiming_one_model_type_is_a_recorded_plugin_error(plugin):
    rival = ArchitectureSpec(name="rival", model_types=("mistral", "rivaltype"), build=lambda *a: None)
    plugin(ArchitecturePlugin(rival), "rival-plugin")
    reasons = failure_reasons()
    assert "rival-plugin" in reasons and "PluginError" in reasons and "mistral" in reasons
    assert get_registry().architecture_for("mistral").name == "llama"
    with pytest.raises(PluginError, match="mistral"):
        registry = Registry()
        registry.add_architecture(ArchitectureSpec(name="a", model_types=("x", "mistral"), build=print))
        registry.add_architecture(rival)


def test_registering_something_that_is_not_a_spec_is_a_recorded_error(plugin):
    plugin(BackendPlugin({"name": "dict-backend"}), "sloppy")
    assert "sloppy" in failure_reasons() and "BackendSpec" in failure_reasons()


# -- entry points -------------------------------------------------------------------------


def test_a_broken_entry_point_is_reported_not_fatal(third_party, rediscover):
    third_party("infer_test_broken", {
        "broken": ("infer_test_broken_mod", 'raise ImportError("needs libfoo.so")\n'),
    })
    rediscover()
    failures = [f for f in get_registry().failures if f.name == "broken"]
    assert len(failures) == 1
    assert failures[0].value == "infer_test_broken_mod"
    assert "ImportError" in failures[0].reason and "needs libfoo.so" in failures[0].reason
    assert "numpy/cpu" in backend_keys()
    assert key(select_backend()) == best_available()


PLUGIN_SOURCE = """
from infer.backends.numpy import NumpyBackend
from infer.plugins.hookspecs import hookimpl
from infer.plugins.registry import BackendSpec, Probe

class B(NumpyBackend):
    name = {name!r}

@hookimpl
def infer_register_backends(register):
    register(BackendSpec(name={name!r}, device="cpu", factory=lambda d: B(d), probe=lambda: Probe(1)))
"""


def test_third_party_entry_point_registers_a_backend(third_party, rediscover):
    third_party("infer_test_tp", {"tp_one": ("infer_test_tp_one", PLUGIN_SOURCE.format(name="tpone"))})
    rediscover()
    info = {b.key: b for b in infer.list_backends()}["tpone/cpu"]
    assert info.plugin == "tp_one" and info.available


@pytest.mark.parametrize("allow", ["tp_allowed", " tp_allowed , other", ""])
def test_allow_list_skips_unlisted_third_party_plugins_keeps_first_party(
        allow, third_party, rediscover, monkeypatch):
    third_party("infer_test_allow", {
        "tp_allowed": ("infer_test_tp_allowed", PLUGIN_SOURCE.format(name="tpallowed")),
        # Never even imported when skipped: importing it would record a failure.
        "tp_skipped": ("infer_test_tp_skipped", 'raise RuntimeError("must not be imported")\n'),
    })
    monkeypatch.setenv("INFER_PLUGINS", allow)
    rediscover()
    keys = backend_keys()
    assert "numpy/cpu" in keys  # first-party plugins always load
    assert {"llama"} <= {a.name for a in infer.list_architectures()}
    assert ("tpallowed/cpu" in keys) == (allow != "")
    assert "must not be imported" not in failure_reasons()
    assert "infer_test_tp_skipped" not in sys.modules


def test_without_allow_list_every_plugin_loads(third_party, rediscover):
    third_party("infer_test_all", {
        "tp_a": ("infer_test_tp_a", PLUGIN_SOURCE.format(name="tpa")),
        "tp_b": ("infer_test_tp_b", PLUGIN_SOURCE.format(name="tpb")),
    })
    rediscover()
    assert {"tpa/cpu", "tpb/cpu", "numpy/cpu"} <= backend_keys()


# -- selection ----------------------------------------------------------------------------


def test_infer_backend_env_selects_a_backend(plugin, monkeypatch):
    plugin(BackendPlugin(backend_spec(score=1)), "lowscore")
    assert key(select_backend()) == best_available()  # higher score wins by default
    monkeypatch.setenv(BACKEND_ENV, "testbk")
    assert isinstance(select_backend(), TestBackend)


def test_explicit_backend_beats_the_env_var(plugin, monkeypatch):
    plugin(BackendPlugin(backend_spec(score=1)), "lowscore")
    monkeypatch.setenv(BACKEND_ENV, "testbk")
    backend = select_backend("numpy")
    assert type(backend) is NumpyBackend
    instance = TestBackend()
    assert select_backend(instance) is instance


def test_env_var_naming_an_unknown_backend_is_an_error(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "nosuchthing")
    with pytest.raises(BackendUnavailableError, match="nosuchthing"):
        select_backend()


def test_unknown_backend_name_lists_the_registered_ones(plugin):
    plugin(BackendPlugin(backend_spec()), "listed")
    with pytest.raises(BackendUnavailableError) as info:
        select_backend("nosuchbackend")
    message = str(info.value)
    assert "nosuchbackend" in message and "numpy/cpu" in message and "testbk/cpu" in message
    with pytest.raises(BackendUnavailableError, match="numpy/cpu"):
        select_backend("numpy:cuda")  # known family, unknown device


def test_selection_logs_the_choice_and_why_others_were_rejected(plugin, caplog):
    plugin(BackendPlugin(backend_spec(score=0, reason="no device"),
                         backend_spec(name="slowbk", score=1)), "two")
    with caplog.at_level(logging.INFO, logger="infer.plugins.selection"):
        select_backend()
    text = caplog.text
    assert f"{best_available()} chosen" in text
    assert "testbk/cpu not usable: no device" in text
    assert "slowbk/cpu" in text and "not chosen" in text


# -- what the first-party plugins register -----------------------------------------------


def test_llama_architecture_is_registered_with_its_model_types():
    archs = {a.name: a for a in infer.list_architectures()}
    assert "llama" in archs
    assert {"llama", "mistral", "qwen2"} <= set(archs["llama"].model_types)


def test_huggingface_format_is_registered():
    formats = infer.list_formats()
    assert "huggingface" in {f.name for f in formats}
    assert all(isinstance(f, FormatSpec) for f in formats)


def test_numpy_backend_is_registered_and_available():
    info = {b.key: b for b in infer.list_backends()}["numpy/cpu"]
    assert info.available and info.score > 0 and info.plugin == "numpy"


def test_first_party_plugins_load_without_failures():
    assert get_registry().failures == [], failure_reasons()


def test_registering_the_same_plugin_name_twice_is_refused(plugin):
    plugin(BackendPlugin(backend_spec()), "dupname")
    with pytest.raises(ValueError):
        register_plugin(BackendPlugin(backend_spec(name="other")), name="dupname")


# -- regressions found while writing the docs -----------------------------------


class _MisspeltHook:
    @hookimpl
    def infer_register_backend(self, register):  # type: ignore[no-untyped-def]  # missing "s"
        raise AssertionError("never called")


def test_misspelt_hook_is_reported_not_ignored() -> None:
    name = register_plugin(_MisspeltHook(), name="misspelt")
    try:
        failures = get_registry().failures
        assert any(f.name and "infer_register_backend" in f.reason for f in failures), failures
    finally:
        unregister_plugin(name)


class _ShadowLlama:
    @hookimpl
    def infer_register_architectures(self, register):  # type: ignore[no-untyped-def]
        register(ArchitectureSpec(name="llama", model_types=("foo",), build=lambda *a: None))


def test_architecture_name_clash_keeps_the_first(plugin) -> None:  # type: ignore[no-untyped-def]
    plugin(_ShadowLlama(), "shadow")
    registry = get_registry()
    assert "mistral" in registry.architectures["llama"].model_types
    assert any("registered twice" in f.reason for f in registry.failures)


def test_backend_instance_with_old_contract_is_refused() -> None:
    class Old(NumpyBackend):
        api_version = (0, 9)

    with pytest.raises(BackendUnavailableError, match="op contract"):
        select_backend(Old())
    with pytest.raises(BackendError, match="bfloat16"):
        select_backend(NumpyBackend(), dtype="bfloat16")


# -- hostile plugins (docs/security.md) --------------------------------------------------


@pytest.fixture
def tiny_model_path():
    from reference import tiny_model_dir

    return tiny_model_dir("llama3")

CLAIMING_SOURCE = """
    from infer.plugins.hookspecs import hookimpl
    from infer.plugins.registry import ArchitectureSpec, BackendSpec, FormatSpec, Probe
    from infer.backends.numpy import NumpyBackend

    @hookimpl
    def infer_register_backends(register):
        register(BackendSpec(name="numpy", device="cpu", factory=NumpyBackend, probe=lambda: Probe(1),
                             description="an impostor"))

    @hookimpl
    def infer_register_architectures(register):
        register(ArchitectureSpec(name="impostor", model_types=("llama",), build=lambda *a: None))

    @hookimpl
    def infer_register_formats(register):
        register(FormatSpec(name="gguf", detect=lambda path: True, open=lambda path: None))
"""


def test_a_third_party_cannot_take_first_party_names_unless_opted_in(third_party, rediscover, monkeypatch):
    third_party("impostor-dist", {"impostor": ("impostor_plugin", CLAIMING_SOURCE)})
    rediscover()
    registry = get_registry()
    assert registry.backends["numpy/cpu"].plugin == "numpy"
    assert registry.architecture_for("llama").name == "llama"
    assert registry.formats["gguf"].plugin == "gguf"
    refused = [f for f in registry.failures if f.name == "impostor"]
    assert len(refused) == 3 and all("refused" in f.reason and "INFER_PLUGINS" in f.reason for f in refused)
    assert not [f for f in registry.failures if f.name in ("numpy", "llama", "gguf")]

    monkeypatch.setenv("INFER_PLUGINS", "impostor")  # the deliberate override
    rediscover()
    registry = get_registry()
    assert registry.backends["numpy/cpu"].plugin == "impostor"
    assert registry.architecture_for("llama").name == "impostor"
    assert registry.architecture_for("mistral").name == "llama"  # only what it claimed moved
    assert registry.formats["gguf"].plugin == "impostor"


EXITING_SOURCES = {
    "exits_at_import": ("exits_plugin", "import sys\nsys.exit(3)\n"),
    "interrupts_in_hook": ("interrupts_plugin", """
        from infer.plugins.hookspecs import hookimpl

        @hookimpl
        def infer_register_backends(register):
            raise KeyboardInterrupt
    """),
    "exits_in_hook": ("exits_hook_plugin", """
        from infer.plugins.hookspecs import hookimpl

        @hookimpl
        def infer_register_formats(register):
            raise SystemExit(4)
    """),
}


def test_a_plugin_that_exits_or_interrupts_is_a_failure_not_the_end(third_party, rediscover, tiny_model_path):
    third_party("rude-dist", EXITING_SOURCES)
    rediscover()
    reasons = {f.name: f.reason for f in get_registry().failures}
    assert reasons["exits_at_import"].startswith("SystemExit")
    assert reasons["interrupts_in_hook"].startswith("KeyboardInterrupt")
    assert reasons["exits_in_hook"].startswith("SystemExit")
    assert infer.load(tiny_model_path, backend="numpy").generate("Hi", max_tokens=1, ignore_eos=True)


class FormatPlugin:
    def __init__(self, *specs) -> None:
        self.specs = specs

    @hookimpl
    def infer_register_formats(self, register):
        for spec in self.specs:
            register(spec)


def test_formats_must_claim_a_path_and_conflicts_are_settled_or_reported(plugin, tmp_path, tiny_model_path):
    from infer.errors import UnsupportedFormatError

    plugin(FormatPlugin(FormatSpec(name="grabby", detect=lambda path: True, open=lambda path: None),
                        FormatSpec(name="vague", detect=lambda path: "yes", open=lambda path: None)), "grabby")
    registry = get_registry()
    assert registry.format_for(tiny_model_path).name == "huggingface"  # the first party's claim wins
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    assert registry.format_for(other).name == "grabby"  # "yes" is no claim: only grabby's True counts
    plugin(FormatPlugin(FormatSpec(name="greedy", detect=lambda path: True, open=lambda path: None)), "greedy")
    with pytest.raises(UnsupportedFormatError, match="grabby, greedy all claim"):
        get_registry().format_for(other)


# -- first-party architectures registered from their index ----------------------------


def test_the_architecture_index_is_what_each_module_registers():
    """infer.plugins.architecture_index stands in for the modules at discovery: each entry must be
    exactly what the module's own hook registers, callables included."""
    import importlib

    from infer.plugins import architecture_index as index

    for module_name, entries in index.INDEX.items():
        module = importlib.import_module(module_name)
        registered: list[ArchitectureSpec] = []
        module.infer_register_architectures(register=registered.append)
        listed = index.specs(module_name)
        assert [(s.name, s.model_types, s.description) for s in listed] == [
            (s.name, s.model_types, s.description) for s in registered], module_name
        for entry, spec in zip(entries, registered):
            assert getattr(module, entry.build) is spec.build, (module_name, entry.name)
            assert (getattr(module, entry.read_config) if entry.read_config else None) is spec.read_config


def test_every_first_party_architecture_is_indexed():
    from importlib.metadata import entry_points

    from infer.plugins import architecture_index as index

    modules = {ep.value for ep in entry_points(group="infer") if ep.value.startswith("infer.architectures.")}
    assert modules == set(index.INDEX)


def test_discovery_imports_no_architecture_module_and_a_build_imports_its_own(tiny_model_path):
    """The stand-ins register every architecture; building a model imports its module alone."""
    code = textwrap.dedent(f"""
        import sys, infer
        registry = infer.get_registry()
        before = sorted(m for m in sys.modules if m.startswith("infer.architectures."))
        spec = registry.architecture_for("llama")
        infer.load({str(tiny_model_path)!r})
        after = {{m for m in sys.modules if m.startswith("infer.architectures.")}}
        print(before, len(registry.architectures), registry.failures, type(spec.build).__name__,
              "infer.architectures.llama" in after, "infer.architectures.gemma4" in after)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "26", "[]", "Deferred", "True", "False"]


# -- entry points and versions read without importing importlib.metadata --------------


def _fake_distributions(folder, dists):
    """Metadata folders: {folder name: (entry_points.txt or None, version)}."""
    for name, (entry_points, version) in dists.items():
        info = folder / name
        info.mkdir()
        (info / ("METADATA" if name.endswith(".dist-info") else "PKG-INFO")).write_text(
            f"Metadata-Version: 2.1\nName: {name.partition('-')[0]}\nVersion: {version}\n\nVersion: not a header\n")
        if entry_points is not None:
            (info / "entry_points.txt").write_text(entry_points)


def test_entry_points_and_versions_are_importlib_metadata_s(tmp_path, monkeypatch):
    """Same entry points in the same order, the first distribution of a name winning across
    and within path folders; same versions; on this environment and on made-up folders."""
    import importlib.metadata

    from infer.plugins import discovery

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    _fake_distributions(first, {
        "Fancy_Plugin-1.0.dist-info": ("# comment\nstray = before.any.section\n[infer]\nfancy = fancy_mod:Thing.attr\n"
                                       "[other]\nx = y\n\n[infer]\n  spaced  =  spaced_mod  \n", "1.0"),
        "legacy.egg-info": ("[infer]\nlegacy = legacy_mod\n", "0.3"),
        "nothing-2.0.dist-info": (None, "2.0"),
    })
    _fake_distributions(second, {
        "fancy.plugin-9.0.dist-info": ("[infer]\nshadowed = never\n", "9.0"),  # same name as Fancy_Plugin: skipped
        "other_plugin-0.1.dist-info": ("[infer]\nother = other_mod\n", "0.1"),
    })
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    for group in ("infer", "other", "console_scripts", "pytest11"):
        ours = [(ep.name, ep.value) for ep in discovery.entry_points(group)]
        theirs = [(ep.name, ep.value) for ep in importlib.metadata.entry_points(group=group)]
        assert ours == theirs, group
    names = [ep.name for ep in discovery.entry_points("infer")]  # a folder's own order is the file system's
    assert sorted(names[:3]) == ["fancy", "legacy", "spaced"] and names[3] == "other" and "shadowed" not in names
    for dist in ("fancy-plugin", "Fancy_Plugin", "legacy", "nothing", "other_plugin", "numpy", "pluggy", "absent-x"):
        try:
            theirs = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            theirs = None
        assert discovery.distribution_version(dist) == theirs, dist


def test_entry_points_fall_back_to_importlib_metadata_where_the_folders_are_not_all(tmp_path, monkeypatch):
    from infer.plugins import discovery

    monkeypatch.syspath_prepend(str(tmp_path / "plugins.zip"))
    (tmp_path / "plugins.zip").write_bytes(b"")  # a file on the path: zips are importlib.metadata's to read
    assert discovery._path_distributions() is None
    assert [ep.name for ep in discovery.entry_points("infer")] == [
        ep.name for ep in __import__("importlib.metadata").metadata.entry_points(group="infer")]


def test_entry_point_values_load_as_importlib_metadata_loads_them():
    from infer.plugins.discovery import _EntryPoint

    assert _EntryPoint("x", "os.path:join").load() is __import__("os").path.join
    assert _EntryPoint("x", "infer.plugins.registry : Registry.add_backend [extra]").load().__name__ == "add_backend"
    with pytest.raises(ValueError, match="not 'module'"):
        _EntryPoint("x", "not a value!").load()


def test_loading_a_model_imports_no_importlib_metadata(tiny_model_path):
    code = (f"import sys, infer; infer.load({str(tiny_model_path)!r}); "
            "print('importlib.metadata' in sys.modules, 'email' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_first_party_modules_register_as_their_hooks_alone():
    """pluggy reads every attribute of a plugin; infer's own modules are registered as the
    functions marked @hookimpl and nothing else, the same functions."""
    from infer.plugins import discovery
    from infer.plugins.discovery import _hooks_only

    for ep in discovery.entry_points("infer"):
        if not ep.value.startswith("infer.") or ep.value.startswith("infer.architectures."):
            continue
        module = ep.load()
        hooks = _hooks_only(module)
        marked = sorted(n for n, v in vars(module).items() if hasattr(v, "infer_impl"))
        assert marked and sorted(dir(hooks)) == marked, ep.value
        assert all(getattr(hooks, n) is getattr(module, n) for n in marked) and hooks.__name__ == module.__name__
    third_party = textwrap  # any module outside infer is registered as it is
    assert _hooks_only(third_party) is third_party
