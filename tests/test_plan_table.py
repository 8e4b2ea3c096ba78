"""The program format has two halves that must agree: the C runner
(backends/cpu/plan.c) decodes opcodes, kinds and dimension limits, and the
Python recorder (backends/cpu/record.py) encodes them. The recorder reads
the opcodes from the runner (``_kernels.opcodes()``), but the kinds and limits
are written out on both sides; so this test parses the C source (no build
needed) and checks every number the two share:

* the ``OP_*`` enum, the ``OPCODES`` name table ``opcodes()`` returns, and
  the names the recorder binds (and, where the extension is built, what it
  returns);
* the unary, binary and reduce kinds (``U_*``, ``B_*``, ``R_*``) against
  ``UNARY_KINDS``, ``BINARY_KINDS`` and ``MAX``/``ARGMAX``/``SUM``;
* ``MAX_DIMS``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infer.backends.cpu import record

PLAN_C = Path(__file__).resolve().parent.parent / "backends" / "cpu" / "plan.c"
_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def _source() -> str:
    return _COMMENTS.sub("", PLAN_C.read_text(encoding="utf-8"))


def c_enums(source: str) -> list[dict[str, int]]:
    """Every ``enum { ... }`` of ``source`` (comments removed), in order, as
    name -> value, counting as C does (from 0, or on from an explicit value)."""
    enums = []
    for body in re.findall(r"\benum\s*\{(.*?)\}", source, re.S):
        values: dict[str, int] = {}
        nxt = 0
        for item in (part.strip() for part in body.split(",")):
            if not item:
                continue
            name, _, value = (s.strip() for s in item.partition("="))
            nxt = int(value, 0) if value else nxt
            values[name] = nxt
            nxt += 1
        enums.append(values)
    return enums


def c_enum(prefix: str) -> dict[str, int]:
    """The one enum whose names all start with ``prefix``, the prefix removed."""
    (found,) = [e for e in c_enums(_source()) if e and all(n.startswith(prefix) for n in e)]
    return {name[len(prefix):]: value for name, value in found.items()}


def test_the_parser_counts_as_c_does() -> None:
    assert c_enums("enum { A = 1, B, C }; enum {X, Y = 5, Z,};") == [{"A": 1, "B": 2, "C": 3},
                                                                     {"X": 0, "Y": 5, "Z": 6}]


def test_the_name_table_lists_every_opcode_under_its_own_name() -> None:
    ops = c_enum("OP_")
    table = re.search(r"OPCODES\[\]\s*=\s*\{(.*?)\};", _source(), re.S)
    assert table is not None, "backends/cpu/plan.c has no OPCODES name table"
    pairs = re.findall(r'\{\s*"(\w+)"\s*,\s*(\w+)\s*\}', table.group(1))
    assert [(name, f"OP_{name}") for name in ops] == pairs  # every opcode, once, in the enum's order


def test_the_recorder_binds_every_opcode_the_runner_decodes() -> None:
    ops = c_enum("OP_")
    bound = {name: getattr(record, name) for name in ops}
    assert len(ops) == 19 and set(bound) == set(ops)
    if record.OPCODES:  # the extension is built: its table is the source's
        assert record.OPCODES == ops
        assert bound == ops
    else:
        assert set(bound.values()) == {-1}  # no extension: no programs


def test_the_kinds_agree() -> None:
    unary = {"CAST_I32": "cast", "GELU_ERF": "gelu"}  # the recorder names ops as the contract does
    assert {unary.get(n, n.lower()): v for n, v in c_enum("U_").items()} == record.UNARY_KINDS
    assert {n.lower(): v for n, v in c_enum("B_").items()} == record.BINARY_KINDS
    assert c_enum("R_") == {"MAX": record.MAX, "ARGMAX": record.ARGMAX, "SUM": record.SUM}


def test_the_dimension_limit_agrees() -> None:
    found = re.search(r"#define\s+MAX_DIMS\s+(\d+)", _source())
    assert found is not None and int(found.group(1)) == record.MAX_DIMS


@pytest.mark.parametrize("prefix", ["OP_", "U_", "B_", "R_"])
def test_each_enum_is_found_once(prefix: str) -> None:
    assert c_enum(prefix)
