"""Instructions per request of the ext_proc process, counted by valgrind's callgrind.

    .venv/bin/python -m bench.instructions [--modes minimal,kvgate] [--seconds 20]
        [--concurrency 16] [--out bench/results/instructions.json]

``bench.overhead`` measures CPU time, which on a shared 2-core machine moves by ±10% from
one window to the next (and by 2× over minutes): a change worth 5% needs many alternating
runs to see. Instructions do not move with the machine. Each mode's ext_proc process runs
under callgrind behind the same gateway as ``bench.overhead`` (its own Envoy and engine);
after a warm-up under load, callgrind's counters are zeroed and dumped around a window of
``--seconds`` under a closed loop of ``--concurrency`` clients, then around an idle window
of the same length. Instructions per request = (loaded − idle) ÷ requests answered: work
that runs on a timer whatever the load (kvgate's scrapes, gRPC's pollers) is taken out, as
under callgrind ~50× fewer requests share it than at full speed.

What this cannot show: time. An instruction costs what its caches and branches make it
cost, and the interpreter's are not a tight loop's; the ratio of instructions is a floor
under the ratio of CPU time, not a prediction of it (both are in the results). Per object
file (``self``): where the instructions ran — the interpreter, gRPC, upb, kvgate's
compiled modules (mypyc).

``--simulate`` also runs valgrind's cache and branch-predictor models (generic ones, not this
machine's CPU): data accesses, cache misses and mispredicted branches per request, to see
whether what makes a request slower than its instruction count says is a working set that
outgrew the caches or branches the predictor misses (the interpreter's dispatch is an
indirect branch per bytecode).

Needs ``valgrind`` (Debian: ``apt-get install valgrind``). About a minute per mode, twice
that with ``--simulate``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from bench import overhead

RESULTS = Path(__file__).parent / "results"
WARMUP_S = 10.0  # under callgrind: the interpreter's caches and gRPC's pools fill slowly
SIMULATED = ("Dr/Dw data reads/writes; I1mr, D1mr/D1mw first-level instruction and data "
             "cache misses; ILmr, DLmr/DLmw last-level misses; Bc/Bcm conditional branches "
             "and mispredicted ones; Bi/Bim indirect branches and mispredicted ones")
_NAME = re.compile(r"^(c?)(ob|fn)=(?:\((\d+)\))?\s*(.*)$")


def callgrind_prefix(out_dir: Path, simulate: bool = False) -> list[str]:
    if shutil.which("valgrind") is None:
        raise SystemExit("bench.instructions needs valgrind (apt-get install valgrind)")
    models = "yes" if simulate else "no"
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/cg.%p",
            f"--cache-sim={models}", f"--branch-sim={models}"]


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def dumped(pid: int, out_dir: Path, label: str) -> Callable[[float], Awaitable[Path]]:
    """A window: zero the counters, wait, dump; returns the dump's file."""
    async def window(seconds: float) -> Path:
        before = set(out_dir.iterdir())
        _control(pid, "--zero")
        await asyncio.sleep(seconds)
        _control(pid, "--dump", label)
        (dump,) = set(out_dir.iterdir()) - before
        return dump

    return window


def own_costs(dump: Path) -> dict[str, collections.Counter[str]]:
    """Each event's count (``Ir``: instructions; with ``--simulate``, ``SIMULATED`` too) in
    each object file's own code, calls' inclusive lines skipped: event → object → count."""
    names: dict[tuple[str, str], str] = {}
    current = "?"
    events: list[str] = ["Ir"]
    found: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    skip_next = False
    for line in dump.read_text(errors="replace").splitlines():
        named = _NAME.match(line)
        if named:
            callee, kind, ident, name = named.groups()
            if ident is not None:
                name = names.setdefault((kind, ident), name) if name else names[(kind, ident)]
            if kind == "ob" and not callee:
                current = Path(name).name or "?"
            continue
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("calls="):
            skip_next = True  # the next cost line is the call's inclusive cost
        elif line[:1].isdigit() or line[:1] in "+-*":
            if not skip_next:  # a position, then the events' counts (trailing zeros left out)
                for event, count in zip(events, line.split()[1:], strict=False):
                    found[event][current] += int(count)
            skip_next = False
    return found


def _short(obj: str) -> str:
    """``cygrpc.cpython-311-x86_64-linux-gnu.so`` → ``cygrpc``; the shared library of
    kvgate's compiled modules → ``kvgate (mypyc)``."""
    if "__mypyc" in obj:
        return "kvgate (mypyc)"
    return obj.split(".cpython-")[0].split(".so")[0]


def measure_mode(mode: str, seconds: float, concurrency: int, work: Path,
                 simulate: bool = False) -> dict[str, Any]:
    out_dir = work / mode
    out_dir.mkdir()
    with overhead.gateway(mode, layout="none",
                          ext_proc_prefix=callgrind_prefix(out_dir, simulate)) as gw:
        pid = gw.pids["ext_proc"]
        loaded_path: list[Path] = []

        async def loaded(s: float) -> None:
            loaded_path.append(await dumped(pid, out_dir, "loaded")(s))

        window = asyncio.run(overhead.measure(gw, concurrency, WARMUP_S, seconds, loaded))
        idle_path = asyncio.run(dumped(pid, out_dir, "idle")(seconds))
        requests = len(window.load.latencies)
        if not requests:
            raise SystemExit(f"{mode}: no request answered 200 under callgrind "
                             f"({dict(window.load.statuses)})")
        loaded, idle = own_costs(loaded_path[0]), own_costs(idle_path)
    by_object = {_short(o): (loaded["Ir"][o] - idle["Ir"][o]) / requests for o in loaded["Ir"]}
    per_request = {event: (sum(loaded[event].values()) - sum(idle[event].values())) / requests
                   for event in loaded}
    return {"mode": mode, "requests": requests, "errors": sum(
                n for status, n in window.load.statuses.items() if status != 200),
            "instructions_per_request": sum(by_object.values()),
            "idle_instructions_per_s": sum(idle["Ir"].values()) / seconds,
            "events_per_request": per_request,
            "by_object": dict(sorted(by_object.items(), key=lambda kv: -kv[1]))}


def table(rows: list[dict[str, Any]]) -> Iterator[str]:
    floor = next((r for r in rows if r["mode"] == "minimal"), None)
    objects = list(dict.fromkeys(o for r in rows for o, v in r["by_object"].items()
                                 if abs(v) >= 1000))[:10]
    yield "| mode | requests | instructions/request | ÷ floor | " + " | ".join(objects) + " |"
    yield "|---|---:|---:|---:|" + "---:|" * len(objects)
    for r in rows:
        ratio = (f"{r['instructions_per_request'] / floor['instructions_per_request']:.2f}"
                 if floor else "–")
        cells = [f"{r['by_object'].get(o, 0) / 1000:.0f}k" for o in objects]
        yield (f"| {r['mode']} | {r['requests']} | {r['instructions_per_request'] / 1000:.0f}k"
               f" | {ratio} | " + " | ".join(cells) + " |")


def simulated_table(rows: list[dict[str, Any]]) -> Iterator[str]:
    """With ``--simulate``: the other events per request (``SIMULATED`` says which is what)."""
    events = [e for e in rows[0]["events_per_request"] if e != "Ir"]
    if not events:
        return
    yield "| mode | " + " | ".join(events) + " |"
    yield "|---|" + "---:|" * len(events)
    for r in rows:
        yield f"| {r['mode']} | " + " | ".join(
            f"{r['events_per_request'].get(e, 0):.0f}" for e in events) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--modes", type=lambda t: t.split(","), default=["minimal", "kvgate"])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--simulate", action="store_true",
                        help="valgrind's cache and branch models too (~2× slower)")
    parser.add_argument("--out", type=Path, default=RESULTS / "instructions.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvgate-callgrind-") as tmp:
        rows = [measure_mode(mode, args.seconds, args.concurrency, Path(tmp), args.simulate)
                for mode in args.modes]
    lines = list(table(rows))
    simulated = list(simulated_table(rows))
    if simulated:
        lines += ["", f"Per request, from valgrind's models (not this CPU's): {SIMULATED}.",
                  "", *simulated]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seconds": args.seconds, "concurrency": args.concurrency,
                                    "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
        "# ext_proc instructions per request (callgrind)\n\n"
        f"`.venv/bin/python -m bench.instructions --modes {','.join(args.modes)} "
        f"--seconds {args.seconds:g} --concurrency {args.concurrency}"
        f"{' --simulate' if args.simulate else ''}`\n\n"
        + "\n".join(lines) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
