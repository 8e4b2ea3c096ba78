"""Load plus the first prompt's encoding, infer against llama.cpp, in fresh processes.

Each run is a new Python process that imports the library, loads the model and
encodes one prompt, then reports its own CPU seconds (user + system, from
``getrusage``: the interpreter's start and every import included) and its peak
RSS. infer's and llama.cpp's runs take turns; the table gives medians.
CPU seconds rather than wall time: on a shared machine wall time moves with
the other jobs far more than CPU time does.

llama.cpp is llama-cpp-python (``Llama(path, vocab_only=False)`` then
``tokenize``), an optional peer: its rows are left out where it is not
installed.

``--tree NAME=DIR`` (repeatable) runs infer from the checkout DIR as the
peer NAME instead of the installed one, for before/after comparisons in one
interleaved run. A checkout keeps ``formats/``, ``backends/`` and
``architectures/`` beside ``infer/`` (pyproject.toml maps them into the
package), so DIR on ``PYTHONPATH`` alone would run its ``infer/`` with the
installed copy's other three: each run imports from a folder whose ``infer``
links to all four of DIR's (whose C extensions must be built in place, as an
editable install builds them; a ``git worktree`` of main gets them by copying
the ``.so`` files of another checkout of the same sources). Every tree's sources, and the installed ones, are
compiled to bytecode first, as an installed package's are (where
``PYTHONDONTWRITEBYTECODE`` is set, each process would compile them again).

``--phases`` instead prints, for infer on each model (medians of
``--repeats`` processes), where its CPU time goes: interpreter start, numpy, infer's imports, plugin discovery, the
GGUF parse, the tokenizer, the weights, the first encoding.

    python benchmarks/load.py MODEL.gguf [MODEL.gguf ...] [--repeats 3] [--tree NAME=DIR ...] [--phases]
"""

from __future__ import annotations

import argparse
import compileall
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = "The capital of France is"

_INFER = """
import resource, sys, time
import infer
imported = time.process_time()
model = infer.load(sys.argv[1])
ids = model.tokenizer.encode(sys.argv[2])
usage = resource.getrusage(resource.RUSAGE_SELF)
print({"cpu": usage.ru_utime + usage.ru_stime, "after_imports": time.process_time() - imported,
       "rss_mb": usage.ru_maxrss / 1024, "tokens": len(ids)})
"""

_LLAMA_CPP = """
import resource, sys, time
from llama_cpp import Llama
imported = time.process_time()
model = Llama(sys.argv[1], vocab_only=False, verbose=False, n_threads=2)
ids = model.tokenize(sys.argv[2].encode(), add_bos=True)
usage = resource.getrusage(resource.RUSAGE_SELF)
print({"cpu": usage.ru_utime + usage.ru_stime, "after_imports": time.process_time() - imported,
       "rss_mb": usage.ru_maxrss / 1024, "tokens": len(ids)})
"""

# Times each phase by wrapping the functions that do it (no profiler: its overhead would
# triple the Python-heavy phases and leave the C ones as they are).
_PHASES = """
import functools, resource, sys, time
clock = time.process_time
start = clock()
import numpy
numpy_done = clock()
import infer
imports_done = clock()
from infer import loading, model as model_module
from infer.formats import gguf_file, gguf_tokenizer
spent = {}
def timed(owner, name, label):
    function = getattr(owner, name)
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        began = clock()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + clock() - began
    setattr(owner, name, wrapper)
timed(loading, "get_registry", "plugin discovery")
timed(gguf_file.GGUFFile, "__init__", "GGUF parse")
timed(gguf_tokenizer, "tokenizer_from_gguf", "tokenizer")
timed(loading, "select_backend", "backend")
timed(model_module.Model, "__init__", "Model()")
load_start = clock()
model = infer.load(sys.argv[1])
load_done = clock()
model.tokenizer.encode(sys.argv[2])
encode_done = clock()
usage = resource.getrusage(resource.RUSAGE_SELF)
phases = {"interpreter start": start, "numpy import": numpy_done - start,
          "infer imports (numpy excluded)": imports_done - numpy_done}
phases.update(spent)
phases["the rest of load (weights, architecture)"] = load_done - load_start - sum(spent.values())
phases["first encoding"] = encode_done - load_done
phases["total (getrusage)"] = usage.ru_utime + usage.ru_stime
print(phases)
"""


#: The folders of a checkout that pyproject.toml maps into the infer package.
PACKAGES = {"formats": "infer.formats", "backends": "infer.backends", "architectures": "infer.architectures"}


def import_root(tree: Path, into: Path) -> Path:
    """A folder under ``into`` from which ``import infer`` runs the checkout ``tree``, all of it
    (its sources compiled to bytecode)."""
    root = into / tree.resolve().name
    package = root / "infer"
    package.mkdir(parents=True)
    for entry in (tree / "infer").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for folder in PACKAGES:
        (package / folder).symlink_to((tree / folder).resolve())
    # The modules of infer/ itself are found through the links, so their bytecode is looked
    # for beside the links; compileall does not follow linked folders, whose bytecode is
    # looked for in the checkout.
    compileall.compile_dir(str(package), quiet=1, maxlevels=0)
    for folder in ["infer", *PACKAGES]:
        compileall.compile_dir(str(tree / folder), quiet=1)
    return root


def compile_installed() -> None:
    """The installed infer's sources to bytecode (an editable install's are plain sources)."""
    for name in ["infer", *PACKAGES.values()]:
        for folder in importlib.import_module(name).__path__:
            compileall.compile_dir(folder, quiet=1)


def run(script: str, model: Path, tree: Path | None = None) -> dict[str, float]:
    """One fresh process running ``script``; ``tree``: import infer from there (-P: not from the cwd)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-P", "-c", script, str(model), PROMPT], capture_output=True, text=True,
                         check=True, env=env)
    return eval(out.stdout.strip().splitlines()[-1], {})  # noqa: S307 - our own child's dict literal


def has_llama_cpp() -> bool:
    return subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phases", action="store_true", help="where infer's CPU time goes, one process per model")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="run infer from the source tree DIR as the peer NAME (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    links = tempfile.TemporaryDirectory(prefix="load-trees-")
    trees = {name: import_root(Path(folder), Path(links.name) / name)
             for name, _, folder in (t.partition("=") for t in args.tree)}
    if not trees:
        compile_installed()
    if args.phases:  # medians of --repeats processes, phase by phase
        for model in args.models:
            for name, tree in (trees or {"infer": None}).items():
                runs = [run(_PHASES, model, tree) for _ in range(args.repeats)]
                print(f"{model.name} ({name}, medians of {args.repeats}):")
                for phase in runs[0]:
                    print(f"  {phase:42s} {statistics.median(r[phase] for r in runs):7.3f} s")
        return

    peers: dict[str, tuple[str, Path | None]] = {name: (_INFER, tree) for name, tree in trees.items()}
    peers = peers or {"infer": (_INFER, None)}
    if has_llama_cpp():
        peers["llama.cpp"] = (_LLAMA_CPP, None)
    results = {}
    print("| model | peer | CPU s (median) | of it after the imports | peak RSS MB (median) | runs (CPU s) |")
    print("|---|---|---:|---:|---:|---|")
    for model in args.models:
        runs: dict[str, list[dict[str, float]]] = {peer: [] for peer in peers}
        for _ in range(args.repeats):  # peers take turns, so a change in the machine's load hits both
            for peer, (script, tree) in peers.items():
                runs[peer].append(run(script, model, tree))
        for peer, got in runs.items():
            cpu = statistics.median(r["cpu"] for r in got)
            late = statistics.median(r["after_imports"] for r in got)
            rss = statistics.median(r["rss_mb"] for r in got)
            results[f"{model.name}/{peer}"] = {"cpu_s": cpu, "after_imports_s": late, "rss_mb": rss, "runs": got}
            each = ", ".join(f"{r['cpu']:.3f}" for r in got)
            print(f"| {model.name} | {peer} | {cpu:.3f} | {late:.3f} | {rss:.0f} | {each} |")
        if "llama.cpp" in runs:
            theirs = results[f"{model.name}/llama.cpp"]
            for peer in runs:
                if peer != "llama.cpp":
                    ours = results[f"{model.name}/{peer}"]
                    print(f"|  | {peer} / llama.cpp | {ours['cpu_s'] / theirs['cpu_s']:.2f}x | "
                          f"{ours['after_imports_s'] / theirs['after_imports_s']:.2f}x | "
                          f"{ours['rss_mb'] / theirs['rss_mb']:.2f}x | |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
