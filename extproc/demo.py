"""``kvgate demo``: the whole data path on one machine, on the embedded defaults.

Simulated vLLM engines on the pools' endpoints, kvgate in this process (in-memory limits,
or Redis where the config names it), and the real Envoy in front. The end-to-end tests
drive the same ``local_stack`` on free ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx

from extproc.config import Config, hash_api_key, parse_endpoint
from extproc.server import KvgateServer, new_event_loop

if TYPE_CHECKING:
    from extproc.engine.server import EngineProcess
    from extproc.envoy_proc import EnvoyProcess

DEMO_KEYS = {"acme": "sk-demo-acme", "globex": "sk-demo-globex", "hobbyist": "sk-demo-free"}


class ServerThread:
    """kvgate's asyncio server on a thread of its own, so callers can stay synchronous."""

    def __init__(self, config: Config):
        self.server = KvgateServer(config)
        self.loop = new_event_loop()  # uvloop where installed, as `kvgate serve` runs
        self._thread = threading.Thread(target=self._run, name="kvgate", daemon=True)
        self._started = threading.Event()
        self._stopping = threading.Event()
        self._grace = 0.5  # what open streams get to finish (stop)
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as exc:  # reported to start()'s caller
            self._error = exc
            self._started.set()
            return
        self._started.set()
        if not self._stopping.is_set():  # a stop() during start() queued loop.stop: runs now
            self.loop.run_forever()
        self.loop.run_until_complete(self.server.stop(grace=self._grace))
        self.loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        self._started.wait(timeout=30)
        if self._error is not None:
            raise RuntimeError(f"kvgate failed to start: {self._error}") from self._error
        return self

    def call(self, coro, timeout: float = 10):  # type: ignore[no-untyped-def]
        """Run a coroutine on kvgate's loop (tests inspect the store this way)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        """Also while start() is under way (a SIGTERM then): the start finishes, then the
        server stops, so no gRPC thread is left running into the interpreter's exit (which
        crashed the process: exit -11). Open streams get ``grace`` seconds to finish."""
        self._grace = grace
        self._stopping.set()
        if self._thread.is_alive():
            self._started.wait(timeout=30)
            with contextlib.suppress(RuntimeError):  # the loop closed as it stopped by itself
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


@dataclass
class Stack:
    kvgate: ServerThread
    envoy: EnvoyProcess
    engines: dict[str, EngineProcess]  # by endpoint

    @property
    def url(self) -> str:
        return self.envoy.url


class Interrupted(Exception):
    """A stop was asked for (SIGTERM, Ctrl-C) while the stack was starting."""


@contextlib.contextmanager
def local_stack(config: Config, *, engine_options: dict | None = None,
                bootstrap: dict | None = None,
                stop: threading.Event | None = None) -> Iterator[Stack]:
    """Engines for every pool endpoint (each speaking its pool's engine's metrics), kvgate,
    then Envoy (on ``bootstrap`` when given, else the one rendered from ``config``); torn
    down in reverse order. Once ``stop`` is set, the next step raises :class:`Interrupted`
    instead of starting (what started is stopped)."""
    from extproc.engine.server import EngineProcess
    from extproc.envoy_proc import EnvoyProcess

    def step() -> None:
        if stop is not None and stop.is_set():
            raise Interrupted

    with contextlib.ExitStack() as stack:
        engines = {}
        for pool in config.pools:
            for endpoint in pool.endpoints:
                step()
                host, port = parse_endpoint(endpoint)
                options = {
                    "model": pool.models[0].name,
                    "scheduling_policy": "priority" if pool.priority_scheduling else "fcfs",
                    "metrics_flavour": pool.engine,  # the engine the pool says it runs
                    **(engine_options or {}),
                }
                engines[endpoint] = stack.enter_context(
                    EngineProcess(port=port, host=host, **options))
        step()
        kvgate = ServerThread(config)
        stack.callback(kvgate.stop)
        kvgate.start()
        step()
        envoy = stack.enter_context(
            EnvoyProcess(config) if bootstrap is None else EnvoyProcess(bootstrap=bootstrap))
        step()
        yield Stack(kvgate, envoy, engines)


def _gateway_url(config: Config) -> str:
    return f"http://{config.envoy.listen_host}:{config.envoy.listen_port}"


def curl_line(config: Config, key: str = DEMO_KEYS["acme"], stream: bool = True,
              quote: str = "'") -> str:
    model = config.pools[0].models[0].name
    body = (
        f'{{"model": "{model}", "max_tokens": 32, "stream": {str(stream).lower()}, '
        '"messages": [{"role": "user", "content": "Tell me about admission control."}]}'
    )
    return (
        f"curl -sN {_gateway_url(config)}/v1/chat/completions "
        f"-H {quote}Authorization: Bearer {key}{quote} -H 'Content-Type: application/json' "
        f"-d '{body}'"
    )


def _smoke(config: Config) -> int:
    """A few requests through the stack, to show (and test) that the demo works."""
    url = _gateway_url(config) + "/v1/chat/completions"
    model = config.pools[0].models[0].name
    body = {"model": model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello there"}]}
    with httpx.Client(timeout=30) as client:
        ok = client.post(url, json=body, headers={"Authorization": f"Bearer {DEMO_KEYS['acme']}"})
        print(f"acme     → {ok.status_code} {ok.json().get('usage')}")
        bad = client.post(url, json=body, headers={"Authorization": "Bearer sk-wrong"})
        print(f"bad key  → {bad.status_code} {bad.json()['error']['message']}")
        statuses = []
        hobbyist = {"Authorization": f"Bearer {DEMO_KEYS['hobbyist']}"}
        for _ in range(6):
            r = client.post(url, json=body, headers=hobbyist)
            statuses.append(r.status_code)
            if r.status_code == 429:
                print(f"hobbyist → 429 after {len(statuses) - 1} admitted; retry-after-ms="
                      f"{r.headers['retry-after-ms']} ({r.json()['error']['message']})")
                break
    return 0 if ok.status_code == 200 and bad.status_code == 401 and 429 in statuses else 1


def demo_ports(config: Config) -> list[tuple[str, int, str]]:
    """What the demo starts besides kvgate, and the setting each port comes from."""
    envoy = config.envoy
    ports = [(envoy.listen_host, envoy.listen_port, "envoy.listen_port"),
             ("127.0.0.1", envoy.admin_port, "envoy.admin_port")]
    for p, pool in enumerate(config.pools):
        for e, endpoint in enumerate(pool.endpoints):
            host, port = parse_endpoint(endpoint)
            ports.append((host, port, f"pools[{p}].endpoints[{e}] (a simulated engine)"))
    return ports


def known_keys(config: Config) -> dict[str, str]:
    """tenant → plain key, for the bundled demo keys this config accepts: configs store
    only hashes, so these are the only keys the demo can print."""
    owners = {key: t.name for t in config.tenants for key in t.api_keys}
    return {owners[hash_api_key(key)]: key for key in DEMO_KEYS.values()
            if hash_api_key(key) in owners}


def _limits_line(config: Config) -> str:
    if config.redis is None:
        return "in-memory limits"
    where = urlsplit(config.redis.url)
    return f"limits in Redis at {where.hostname or where.path}" + (
        f":{where.port}" if where.port else "")


def run_demo(config: Config, *, smoke: bool = False, source: object = "the bundled config") -> int:
    keys = known_keys(config)
    if smoke and not {"acme", "hobbyist"} <= keys.keys():
        print(f"--smoke sends the bundled demo keys of acme and hobbyist, which {source} "
              "does not accept; run it without --smoke", file=sys.stderr)
        return 2
    print(f"starting {_engines_line(config)}, kvgate ({_limits_line(config)}) and Envoy …")
    # SIGTERM stops everything started, as Ctrl-C does, from the first engine on: with the
    # handler set only once "Ctrl-C to stop." was printed, a SIGTERM before it killed the
    # demo and left its engines running, holding their ports. SIGINT is set too: a demo
    # started in the background of a script inherits it ignored, and then a SIGINT to its
    # process group stopped the engines and Envoy (they set their own) but not kvgate.
    # The handler only sets an event, checked between the start's steps: raising
    # KeyboardInterrupt from it, as the demo did, raised it wherever the main thread was,
    # and inside gRPC's Cython code it was printed and dropped ("Exception ignored"): the
    # demo then waited forever (and, once in 24 tries, died of its SIGINT exit instead).
    # SIGHUP too (a closed terminal, or a reload meant for `kvgate serve`): its default
    # killed the demo at once and left an engine running on its port.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        return _run_stack(config, keys, smoke, source, stop)
    except Interrupted:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "trtllm": "TensorRT-LLM"}


def _engines_line(config: Config) -> str:
    """``2 simulated vLLM engine(s)``, each pool's engine kind named (the simulated engine
    exports the kind's metrics)."""
    counts: dict[str, int] = {}
    for pool in config.pools:
        name = _ENGINE_NAMES.get(pool.engine, pool.engine)
        counts[name] = counts.get(name, 0) + len(pool.endpoints)
    return " and ".join(f"{n} simulated {name} engine(s)" for name, n in counts.items())


def _run_stack(config: Config, keys: dict[str, str], smoke: bool, source: object,
               stop: threading.Event) -> int:
    with local_stack(config, stop=stop) as stack:
        kvgate = stack.kvgate
        admin = f"http://{config.server.admin_host}:{kvgate.server.admin_port}"
        print(f"\nEnvoy gateway : {_gateway_url(config)}")
        print(f"kvgate ext_proc: {config.server.host}:{kvgate.server.grpc_port}")
        if config.server.admin_port is not None:
            print(f"status page   : {admin}/  (metrics: {admin}/metrics)")
        if keys:
            print("API keys      : " + ", ".join(f"{k} ({t})" for t, k in keys.items()))
            print("\nTry:\n  " + curl_line(config, next(iter(keys.values()))) + "\n")
        else:
            print(f"API keys      : {source} stores only hashes of its tenants' keys, so the "
                  "demo cannot know them; put one of your own keys in $KVGATE_API_KEY")
            print("\nTry:\n  " + curl_line(config, "$KVGATE_API_KEY", quote='"') + "\n")
        if smoke:
            return _smoke(config)
        print("Ctrl-C to stop.", flush=True)
        stop.wait()  # until Ctrl-C, SIGTERM or SIGHUP
        # as `kvgate serve` drains: open streams finish while Envoy still carries them (the
        # stack's own teardown stops Envoy first, which cut them)
        grace = config.server.shutdown_grace_s
        print(f"stopping: open requests get up to {grace:g} s to finish", flush=True)
        kvgate.stop(grace=grace)
    return 0
