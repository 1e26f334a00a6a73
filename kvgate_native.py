"""kvgate's optional compiled hot path: build it (``python -m kvgate_native``), and load it.

The request path's synchronous modules (pricing, placement, limiter math, reply and refusal
building, response metering) are compiled with mypyc into ``build/native/``; ``extproc`` and
``limiter`` put that folder first on their package ``__path__`` when it is there and was
built from exactly the sources beside it (sha256 of every module of both packages).
Otherwise, or with ``KVGATE_NATIVE=0``, they run as plain Python, identical in behaviour:
the build is an optimisation only (measured in ``bench/results/overhead.md``).

Only modules without coroutines are compiled: a mypyc-compiled coroutine that is cancelled
mid-await can crash the process (python/mypy#12867, reproduced here with kvgate's own
queueing path), and kvgate cancels coroutines whenever a client goes away. The build
refuses a module that defines one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import sysconfig
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MODULES = (  # the synchronous request path; no ``async def`` allowed (see above)
    "extproc.accounting",
    "extproc.classify",
    "extproc.messages",
    "extproc.meter",
    "extproc.metrics",
    "extproc.openai",
    "extproc.pricing",
    "extproc.rejections",
    "extproc.scheduler",
    "extproc.tenants",
    "extproc.tokens",
    "limiter.buckets",
    "limiter.calendar",
    "limiter.clock",
    "limiter.decision",
    "limiter.outcome",
    "limiter.quota",
    "limiter.rates",
    "limiter.stores.redis_codec",
)
PACKAGES = ("extproc", "limiter")
MANIFEST = "manifest.json"
RUNTIME = "runtime"
_COROUTINE = re.compile(r"^\s*async\s+def\s", re.MULTILINE)


def build_dir() -> Path:
    return Path(os.environ.get("KVGATE_NATIVE_DIR") or ROOT / "build" / "native")


def source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def source_hashes() -> dict[str, str]:
    """sha256 of every module of both packages, compiled or not: compiled code is built
    against the others' classes and signatures, so any edit makes a build stale."""
    files = sorted(f for package in PACKAGES for f in (ROOT / package).rglob("*.py"))
    return {".".join(f.relative_to(ROOT).with_suffix("").parts):
            hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


# -- loading -------------------------------------------------------------------------------


def activate(package: str, path: list[str]) -> None:
    """Called first thing by each package with compiled modules (``extproc``, ``limiter``,
    ``limiter.stores``): serve them from the build folder, when there is a usable build."""
    build = usable_build()
    if build is None:
        return
    path.insert(0, str(build.joinpath(*package.split("."))))
    runtime = str(build / RUNTIME)  # mypyc's shared module, imported by top-level name
    if runtime not in sys.path:
        sys.path.append(runtime)  # (not the build folder: its package folders would shadow)


def status() -> str:
    """One line for logs and benchmark reports: which hot path this process runs."""
    return _decision()[1]


def usable_build() -> Path | None:
    return _decision()[0]


@functools.cache
def _decision() -> tuple[Path | None, str]:
    if os.environ.get("KVGATE_NATIVE", "1") == "0":
        return None, "pure Python (KVGATE_NATIVE=0)"
    build = build_dir()
    try:
        manifest = json.loads((build / MANIFEST).read_text())
    except (OSError, ValueError):
        return None, "pure Python (no compiled build: run `make native`)"
    if manifest.get("abi") != _abi() or manifest.get("sources") != source_hashes():
        reason = f"the compiled build in {build} is stale: run `make native`"
        warnings.warn(f"kvgate: {reason}; running pure Python", RuntimeWarning, stacklevel=3)
        return None, f"pure Python ({reason})"
    return build, f"compiled (mypyc {manifest.get('mypy')}, {len(MODULES)} modules)"


def _abi() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag


# -- building ------------------------------------------------------------------------------


def build(out: Path) -> None:
    """Compile MODULES in a scratch copy of the packages, then move the extension modules
    (and mypyc's shared runtime) into ``out`` with a manifest of the sources they came from."""
    import shutil
    import subprocess
    import tempfile

    import mypy.version

    hashes = source_hashes()  # first: a source edited while compiling makes a stale build
    for module in MODULES:
        if _COROUTINE.search(source(module).read_text()):
            raise SystemExit(f"{module} defines a coroutine: it cannot be compiled "
                             "(python/mypy#12867); move it out of kvgate_native.MODULES")
    with tempfile.TemporaryDirectory(prefix="kvgate-native-") as scratch:
        work = Path(scratch)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, work / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        files = [str(source(m).relative_to(ROOT)) for m in MODULES]
        config = str(ROOT / "pyproject.toml")  # [tool.mypy]
        done = subprocess.run([sys.executable, "-m", "mypyc", "--config-file", config, *files],
                              cwd=work, capture_output=True, text=True)
        if done.returncode:  # mypy's type errors, or the C compiler's: shown only then
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"kvgate: mypyc failed (exit {done.returncode}); kvgate runs as "
                             "plain Python until `make native` succeeds")
        if out.exists():
            shutil.rmtree(out)
        for folder in (*PACKAGES, RUNTIME):
            (out / folder).mkdir(parents=True)
        suffix = _abi()
        for module in MODULES:
            relative = Path(*module.split(".")).with_suffix(suffix)
            (out / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(work / relative, out / relative)
        for runtime in work.glob(f"*__mypyc{suffix}"):
            shutil.move(runtime, out / RUNTIME / runtime.name)
    manifest = {"abi": suffix, "mypy": mypy.version.__version__, "sources": hashes}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def main() -> None:
    """Build into $KVGATE_NATIVE_DIR (default ``build/native`` beside the packages), where
    the loader looks."""
    out = build_dir()
    build(out)
    print(f"kvgate: compiled {len(MODULES)} modules into {out}")


if __name__ == "__main__":
    main()
