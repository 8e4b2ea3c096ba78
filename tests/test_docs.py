"""The code in docs/ runs.

Conventions for fenced code blocks in ``docs/*.md`` (the first word of the
info string is the language, so every renderer still highlights them):

- ```` ```python ```` — runs. A page's blocks run in order, in one namespace,
  so later blocks use what earlier ones defined. The namespace starts with
  ``MODEL_PATH``: the folder of a tiny random llama-family model
  (``tests/reference.py``'s ``tiny_model_dir("smollm2_like")``), which is why
  the docs' examples print gibberish. A block that raises fails the test,
  with a traceback whose line numbers are those of the Markdown file.
- ```` ```python no-test ```` — shown, never run (e.g. ``MODEL_PATH = ...``
  for a real model, or code that needs hardware).
- ```` ```python file=NAME.py ```` — not run: written to ``NAME.py`` in a
  temporary folder put on ``sys.path``, so that later blocks can
  ``import NAME`` exactly as a reader who saved the file would.
- In a block that runs, lines starting with ``#>`` are what the block
  prints, one ``#>`` line per line of output, in order; ``...`` stands for
  any text (as doctest's ELLIPSIS). When a block has them, its whole output
  must match them, so a printed count or name quoted in the docs cannot go
  stale; quote output only so, where it is deterministic.
- Every other language (``console``, ``toml``, ``text``) is not run; but each
  ``$ infer ...`` line of a ``console`` block must parse with infer's CLI
  parser, so the documented flags exist. One console block is run: the
  plugin tutorial's ``pytest --pyargs infer.testing``, whose output must be
  what the page shows, the time aside.

Each page runs with the plugin registry, ``INFER_BACKEND``, ``INFER_PLUGINS``
and the root logger restored afterwards, so pages cannot leak into each other
or into the rest of the suite.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import infer
import infer.plugins
from infer.tools.cli import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
README = DOCS.parent / "README.md"

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass
class Block:
    """One fenced code block of a Markdown page."""

    language: str
    options: list[str]
    source: str
    #: Line (1-based) of the first line of code, in the Markdown file.
    line: int

    @property
    def runs(self) -> bool:
        return self.language == "python" and not self.options

    @property
    def file(self) -> str | None:
        for option in self.options:
            if option.startswith("file="):
                return option[len("file="):]
        return None

    @property
    def output(self) -> str | None:
        """What the block says it prints (its ``#>`` lines), or None."""
        lines = [line[3:] if line.startswith("#> ") else line[2:] for line in self.source.splitlines()
                 if line.startswith("#>")]
        return "\n".join(lines) if lines else None


def output_matches(expected: str, printed: str) -> bool:
    """Whether ``printed`` is ``expected``, where ``...`` in ``expected`` stands for any text."""
    pattern = ".*?".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern.rstrip("\n"), printed.rstrip("\n"), re.DOTALL) is not None


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, in order (CommonMark fences)."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m["fence"], m["info"].split()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])
        ):
            body.append(lines[j])
            j += 1
        found.append(Block(info[0].lower() if info else "", info[1:], "\n".join(body) + "\n", i + 2))
        i = j + 1
    return found


def test_fence_parser() -> None:
    text = "x\n```python\na = 1\n```\n\n```python no-test\nb\n```\n```python file=m.py\nc = 2\n```\n"
    found = blocks(text)
    assert [(b.language, b.options, b.source, b.line) for b in found] == [
        ("python", [], "a = 1\n", 3),
        ("python", ["no-test"], "b\n", 7),
        ("python", ["file=m.py"], "c = 2\n", 10),
    ]
    assert [b.runs for b in found] == [True, False, False]
    assert found[2].file == "m.py"


def test_output_lines() -> None:
    (block,) = blocks("```python\nprint(1, [2])\n#> 1 [2]\nprint()\n#>\nprint('a')\n#> a\n```\n")
    assert block.output == "1 [2]\n\na" and output_matches(block.output, "1 [2]\n\na\n")
    assert output_matches("1 [...] x", "1 [2, 3] x\n") and output_matches("...\nb", "a\nz\nb")
    assert not output_matches("63 [2]", "72 [2]\n") and not output_matches("1", "1\n2\n")
    assert blocks("```python\nprint(1)  # 1\n```\n")[0].output is None


@pytest.fixture(scope="module")
def model_path() -> str:
    """The tiny model the docs' ``MODEL_PATH`` names."""
    try:
        from reference import tiny_model_dir

        return str(tiny_model_dir("smollm2_like"))
    except ImportError as exc:  # pragma: no cover - the test extras (transformers, torch) are missing
        pytest.skip(f"the tiny example model cannot be built: {exc}")


@pytest.fixture
def isolated(tmp_path: Path):
    """Restore everything a page may change: plugins, environment, logging, sys.path."""
    manager = infer.plugins.plugin_manager()
    plugins_before = {name for name, _ in manager.list_name_plugin()}
    env_before = {k: os.environ.get(k) for k in ("INFER_BACKEND", "INFER_PLUGINS")}
    root = logging.getLogger()
    logging_before = (root.level, list(root.handlers), logging.getLogger("infer").level)
    modules_before = set(sys.modules)
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in set(sys.modules) - modules_before:
            if getattr(sys.modules[name], "__file__", None) and str(tmp_path) in sys.modules[name].__file__:
                del sys.modules[name]
        root.setLevel(logging_before[0])
        for handler in root.handlers[:]:
            if handler not in logging_before[1]:
                root.removeHandler(handler)
        logging.getLogger("infer").setLevel(logging_before[2])
        env_changed = False
        for key, value in env_before.items():
            if os.environ.get(key) != value:
                env_changed = True
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if env_changed:
            infer.plugins.reload_plugins()
        else:
            manager = infer.plugins.plugin_manager()
            for name, _ in manager.list_name_plugin():
                if name not in plugins_before:
                    infer.plugins.unregister_plugin(name)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_run(page: Path, model_path: str, isolated: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}", "MODEL_PATH": model_path}
    for block in blocks(page.read_text(encoding="utf-8")):
        if block.language != "python":
            continue
        if block.file:
            (isolated / block.file).write_text(block.source, encoding="utf-8")
            continue
        if not block.runs:
            continue
        # Pad so that tracebacks give the line numbers of the Markdown file.
        code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed) if block.output is not None else contextlib.nullcontext():
                exec(code, namespace)
        except Exception as exc:
            raise AssertionError(
                f"{page.name}: the python block at line {block.line} raised {type(exc).__name__}: {exc}"
            ) from exc
        if block.output is not None and not output_matches(block.output, printed.getvalue()):
            raise AssertionError(f"{page.name}: the python block at line {block.line} printed\n"
                                 f"{printed.getvalue()}\nwhere its #> lines say\n{block.output}")


def _command_lines(page: Path) -> list[tuple[int, list[str]]]:
    found = []
    for block in blocks(page.read_text(encoding="utf-8")):
        if block.language not in ("console", "shell-session"):
            continue
        for offset, line in enumerate(block.source.splitlines()):
            if not line.startswith("$ "):
                continue
            command = line[2:].split(" | ")[-1]  # `printf ... | infer chat ...`
            words = shlex.split(command)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # `INFER_BACKEND=numpy infer ...`
                words = words[1:]
            if words and words[0] == "infer":
                found.append((block.line + offset, words[1:]))
    return found


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_documented_commands_parse(page: Path) -> None:
    parser = build_parser()
    for line, argv in _command_lines(page):
        if argv and argv[-1] in ("--help", "-h"):
            continue
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{page.name}:{line}: `infer {shlex.join(argv)}` does not parse") from exc


def _ends_no_line(node: ast.AST) -> bool:
    """``print(..., end=X)`` with an ``X`` that holds no newline."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
            and any(k.arg == "end" and not (isinstance(k.value, ast.Constant) and "\n" in str(k.value.value))
                    for k in node.keywords))


def _is_newline(node: ast.stmt) -> bool:
    """A bare ``print()``."""
    call = node.value if isinstance(node, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print"
            and not call.args and not call.keywords)


@pytest.mark.parametrize("page", PAGES + [README], ids=[p.name for p in PAGES + [README]])
def test_streamed_text_ends_its_line(page: Path) -> None:
    """A loop that prints chunks without newlines (``print(chunk, end="")``)
    is followed by ``print()``: otherwise the next output is glued onto the
    streamed text (README's first example once printed the chat reply so)."""
    for block in blocks(page.read_text(encoding="utf-8")):
        if block.language != "python":
            continue
        for node in ast.walk(ast.parse(block.source)):
            for field in ("body", "orelse", "finalbody"):
                body = getattr(node, field, None)
                if not isinstance(body, list):
                    continue
                for i, stmt in enumerate(body):
                    if isinstance(stmt, (ast.For, ast.While)) and any(map(_ends_no_line, ast.walk(stmt))):
                        after = body[i + 1] if i + 1 < len(body) else None
                        assert after is not None and _is_newline(after), (
                            f"{page.name}:{block.line + stmt.lineno - 1}: the loop prints without a newline "
                            "and no print() follows it")


def test_cli_page_has_commands() -> None:
    assert len(_command_lines(DOCS / "cli.md")) >= 5


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    anchors = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


def test_links_between_pages_resolve() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md)?(?:#([^)\s]*))?\)", text):
            file = page.parent / target if target else page
            if target or anchor:
                assert file.is_file(), f"{page.name} links to missing {target}"
            if anchor:
                assert anchor in _anchors(file), f"{page.name} links to missing anchor {target}#{anchor}"


def test_index_lists_every_page() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in PAGES:
        if page.name != "index.md":
            assert f"({page.name})" in index, f"index.md does not link {page.name}"


def test_entry_point_plugin_and_allow_list(isolated: Path) -> None:
    """plugins.md's packaging section: an installed distribution with an
    ``infer`` entry point is discovered, and ``INFER_PLUGINS`` filters it as
    documented in concepts.md."""
    _install_counting_plugin(isolated)
    dist = isolated / "infer_counting-0.1.dist-info"

    def keys() -> set[str]:
        infer.plugins.reload_plugins()
        return {b.key for b in infer.list_backends()}

    try:
        os.environ.pop("INFER_PLUGINS", None)
        assert {"numpy/cpu", "counting/cpu"} <= keys()
        os.environ["INFER_PLUGINS"] = "counting"
        assert {"numpy/cpu", "counting/cpu"} <= keys()
        os.environ["INFER_PLUGINS"] = "something-else"
        assert "counting/cpu" not in keys() and "numpy/cpu" in keys()
        os.environ["INFER_PLUGINS"] = ""
        assert "counting/cpu" not in keys() and "numpy/cpu" in keys()
    finally:
        os.environ.pop("INFER_PLUGINS", None)
        dist.joinpath("entry_points.txt").unlink()
        infer.plugins.reload_plugins()


def _install_counting_plugin(folder: Path) -> None:
    """plugins.md's ``infer_counting`` as an installed distribution in ``folder``
    (put it on ``sys.path``): the module and the dist-info of its entry point."""
    (folder / "infer_counting.py").write_text(_file_block(DOCS / "plugins.md", "infer_counting.py"), encoding="utf-8")
    dist = folder / "infer_counting-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: infer-counting\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[infer]\ncounting = infer_counting\n")


def test_conformance_command_prints_what_plugins_md_shows(tmp_path: Path) -> None:
    """The tutorial's ``pytest --pyargs infer.testing`` run, with the counting
    plugin installed, prints the progress and counts the page shows (all but
    the time)."""
    (block,) = [b for b in blocks((DOCS / "plugins.md").read_text(encoding="utf-8"))
                if "$ pytest --pyargs infer.testing" in b.source]
    lines = block.source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$ pytest "))
    shown = lines[start + 1:]
    _install_counting_plugin(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INFER_CONFORMANCE_", "INFER_PLUGINS", "PYTEST_"))}
    # 80 columns, as the page shows; 2 examples per case instead of 25, for
    # speed: the counts do not depend on it.
    env.update(PYTHONPATH=str(tmp_path), COLUMNS="80", INFER_CONFORMANCE_EXAMPLES="2")
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"] + shlex.split(lines[start][2:])[1:]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    def untimed(text: list[str]) -> list[str]:
        return [re.sub(r" in [0-9.]+s( \([0-9:]+\))?$", " in Ns", line.rstrip()) for line in text if line.strip()]

    assert untimed(done.stdout.splitlines()) == untimed(shown), done.stdout[-3000:] + done.stderr[-3000:]


def test_conformance_page_counts_the_cases() -> None:
    from infer.testing.cases import CASES
    from infer.testing.tiny_model import VARIANTS

    text = " ".join((DOCS / "conformance.md").read_text(encoding="utf-8").split())
    m = re.search(r"Each dtype runs (\d+) op cases and (\d+) end-to-end models, so a backend with three float "
                  r"dtypes gets (\d+) tests", text)
    assert m, "conformance.md no longer says how many tests a dtype runs; update this test"
    assert tuple(map(int, m.groups())) == (len(CASES), len(VARIANTS), 3 * (len(CASES) + len(VARIANTS)))


def _file_block(page: Path, name: str) -> str:
    for block in blocks(page.read_text(encoding="utf-8")):
        if block.file == name:
            return block.source
    raise AssertionError(f"{page.name} has no ```python file={name} block")

