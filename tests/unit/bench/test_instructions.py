"""``bench.instructions``: reading callgrind's dumps, and the table."""

from __future__ import annotations

from pathlib import Path

from bench.instructions import own_costs, simulated_table, table

# callgrind's format, compressed names included: ``ob=(1) name`` defines id 1, ``ob=(1)``
# reuses it; a ``calls=`` line is followed by the call's inclusive cost, not the caller's own
DUMP = """\
version: 1
creator: callgrind-3.19.0
events: Ir I1mr
ob=(1) /usr/lib/libpython3.11.so.1.0
fl=(1) ceval.c
fn=(1) _PyEval_EvalFrameDefault
10 500 3
+2 250
cob=(2) /venv/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so
cfi=(2) ???
cfn=(2) 0x0000000000866940
calls=3 0
* 10000 40
ob=(2)
fl=(2)
fn=(2)
0 400 2
ob=(3) /build/native/runtime/ae2ec01e__mypyc.cpython-311-x86_64-linux-gnu.so
fn=(3) CPyDef_stream___handle
-1 60
totals: 11210
"""


def test_own_instructions_by_object_file_without_the_calls_inclusive_costs(tmp_path: Path):
    dump = tmp_path / "cg.1"
    dump.write_text(DUMP)
    found = own_costs(dump)
    assert found["Ir"] == {"libpython3.11.so.1.0": 750,
                           "cygrpc.cpython-311-x86_64-linux-gnu.so": 400,
                           "ae2ec01e__mypyc.cpython-311-x86_64-linux-gnu.so": 60}
    assert found["I1mr"] == {"libpython3.11.so.1.0": 3,  # (a line that left a count out: 0)
                             "cygrpc.cpython-311-x86_64-linux-gnu.so": 2}


def test_the_table_gives_each_mode_against_the_floor():
    rows = [{"mode": "minimal", "requests": 10, "instructions_per_request": 600_000,
             "by_object": {"libpython3.11": 300_000, "cygrpc": 300_000}},
            {"mode": "kvgate", "requests": 8, "instructions_per_request": 900_000,
             "by_object": {"libpython3.11": 600_000, "cygrpc": 120_000,
                           "kvgate (mypyc)": 180_000}}]
    lines = list(table(rows))
    assert lines[0].startswith("| mode | requests | instructions/request | ÷ floor |")
    assert lines[2] == "| minimal | 10 | 600k | 1.00 | 300k | 300k | 0k |"
    assert lines[3] == "| kvgate | 8 | 900k | 1.50 | 600k | 120k | 180k |"


def test_the_simulated_events_are_tabled_only_when_simulated():
    row = {"mode": "kvgate", "events_per_request": {"Ir": 9e5, "I1mr": 1234.4, "D1mr": 88}}
    assert list(simulated_table([row])) == ["| mode | I1mr | D1mr |", "|---|---:|---:|",
                                         "| kvgate | 1234 | 88 |"]
    assert list(simulated_table([{"mode": "kvgate", "events_per_request": {"Ir": 1.0}}])) == []
