"""Where the ext_proc servers' CPU goes by shared object (Linux ``perf``), floor and kvgate.

    .venv/bin/python -m bench.perf_extproc [MODES] [OUTDIR]   # minimal,kvgate /tmp/kvgate-perf

Each mode's stack from ``bench.overhead`` at c=16 (split layout), with ``perf record -F 999 -g``
on its ext_proc process for an 8 s window; prints the measured row, then ``perf report
--sort dso`` for each. py-spy (``bench.overhead --profile``) sees Python frames only; this
shows the interpreter, gRPC's Cython core, upb, uvloop and the kernel apart.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from bench import overhead as o


def main(argv: list[str]) -> None:
    modes = (argv[0] if argv else "minimal,kvgate").split(",")
    out = Path(argv[1] if len(argv) > 1 else "/tmp/kvgate-perf")
    out.mkdir(parents=True, exist_ok=True)
    with o._own_affinity(o.LAYOUTS["split"]["loadgen"]), o._runner() as runner:
        for mode in modes:
            with o.gateway(mode) as gw:
                async def window(seconds: float, pid: int = gw.pids["ext_proc"],
                                 data: Path = out / f"{mode}.data") -> None:
                    perf = await asyncio.create_subprocess_exec(
                        "perf", "record", "-F", "999", "-g", "-p", str(pid), "-o", str(data),
                        "--", "sleep", str(seconds), stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL)
                    await perf.wait()

                measured = runner.run(o.measure(gw, o.CPU_RATIO_LEVEL, 2.0, 8.0, window))
                print(o.format_row(o.summarize(mode, o.CPU_RATIO_LEVEL, [measured])), flush=True)
    for mode in modes:
        print(f"== {mode}")
        report = subprocess.run(
            ["perf", "report", "-i", str(out / f"{mode}.data"), "--no-children", "--sort",
             "dso", "--stdio", "-g", "none"], capture_output=True, text=True, check=False)
        lines = [line for line in report.stdout.splitlines()
                 if line.strip() and not line.startswith("#")]
        print("\n".join(lines[:12]))


if __name__ == "__main__":
    main(sys.argv[1:])
