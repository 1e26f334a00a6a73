"""The ``kvgate`` command line: every problem of a config in one run, one clear line (never
a traceback) for bad input to every verb and for ports already taken, ``--version`` and a
clean ``--help``, and a demo that only prints keys and facts its config supports.

Subprocesses where the point is what a user sees (no traceback, the exit status)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.cli import main
from extproc.config import (
    EXAMPLE_CONFIG,
    ConfigError,
    hash_api_key,
    load_config,
    parse_config,
    upstream_authorizations,
)
from extproc.demo import DEMO_KEYS, _engines_line, _limits_line, known_keys
from extproc.engine.server import EngineProcess
from extproc.ports import PortInUse
from tests.conftest import consecutive_free_ports, free_port, wait_for

GOOD = {
    "tiers": {"gold": {"limits": {"requests_per_second": 2}}},
    "tenants": [{"name": "a", "tier": "gold", "api_keys": [hash_api_key("sk-mine")]}],
    "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:8000"]}],
}


def kvgate(*args: str, stdin: str | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "extproc.cli", *args], input=stdin,
                          stdin=subprocess.DEVNULL if stdin is None else None,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def write(tmp_path: Path, data: object, name: str = "kvgate.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.fixture
def taken() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# -- kvgate check -----------------------------------------------------------------------------


def check_problems(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["check", *args, str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"{path}: ")
    return [line.strip() for line in err[1:]]


def test_check_reports_field_errors_and_cross_references_together(tmp_path, capsys):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["tiers"]["gold"]["limits"]["requests_per_second"] = -1
    data["tenants"].append({"name": "b", "tier": "platinum", "api_keys": ["plain-key"],
                            "default_class": "vip"})
    data["tenants"].append({"name": "c", "tier": "silver", "api_keys": [hash_api_key("c")]})
    found = check_problems(write(tmp_path, data), capsys)
    assert any(p.startswith("tiers.gold.limits.requests_per_second: Input should") for p in found)
    assert any(p.startswith("tenants[1].api_keys: API keys are stored as sha256") for p in found)
    # the cross-references of the broken tenant and of the others, in the same run
    assert "tenants[1].tier: unknown tier 'platinum' (known: gold)" in found
    assert any(p.startswith("tenants[1].default_class: unknown class 'vip'") for p in found)
    assert "tenants[2].tier: unknown tier 'silver' (known: gold)" in found
    assert len(found) == 5, found


def test_cross_references_are_checked_when_every_pool_or_tenant_is_broken(tmp_path, capsys):
    """The only pool broken (taken out of the copy the cross-references are checked on)
    left no pool at all, and the check stopped there: the tenant's unknown tier was never
    reported. A stand-in takes the emptied list's place."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["pools"][0]["endpoints"] = ["localhost:8000"]  # a hostname: not ip:port
    data["tenants"][0]["tier"] = "silver"
    found = check_problems(write(tmp_path, data), capsys)
    assert found[0].startswith("pools[0].endpoints[0]:")
    assert found[1:] == ["tenants[0].tier: unknown tier 'silver' (known: gold)"]
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["tenants"][0]["api_keys"] = ["plain-key"]
    data["pools"].append({**data["pools"][0], "name": data["pools"][0]["name"]})
    found = check_problems(write(tmp_path, data), capsys)
    assert found[0].startswith("tenants[0].api_keys: API keys are stored as sha256")
    assert found[1:] == [f"pools[1].name: duplicate pool {data['pools'][0]['name']!r}",
                         f"pools[1].models[0]: {data['pools'][0]['models'][0]!r} already "
                         f"served by {data['pools'][0]['name']!r}"]


def test_a_tenant_missing_a_field_keeps_the_others_indexes(tmp_path, capsys):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["tenants"].insert(0, {"tier": "gold"})  # no name, no keys
    data["tenants"].append({"name": "z", "tier": "bronze", "api_keys": [hash_api_key("z")]})
    found = check_problems(write(tmp_path, data), capsys)
    assert "tenants[0].name: Field required" in found
    assert "tenants[2].tier: unknown tier 'bronze' (known: gold)" in found


def test_unknown_keys_get_a_did_you_mean(tmp_path, capsys):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["tiers"]["gold"]["limits"]["tokens_per_minuet"] = 5
    data["pools"][0]["watermark"] = {"high": 0.5}
    data["server"] = {"grpc_prot": 1}
    data["tiers"]["gold"]["zzz"] = 1
    found = check_problems(write(tmp_path, data), capsys)
    assert ("tiers.gold.limits.tokens_per_minuet: unknown key 'tokens_per_minuet': "
            "did you mean 'tokens_per_minute'?") in found
    assert "pools[0].watermark: unknown key 'watermark': did you mean 'watermarks'?" in found
    assert "server.grpc_prot: unknown key 'grpc_prot': did you mean 'grpc_port'?" in found
    assert ("tiers.gold.zzz: unknown key 'zzz' (known: limits, long_prompt_tokens, overflow, "
            "weight)") in found


def test_every_bad_endpoint_is_reported(tmp_path, capsys):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["pools"][0]["endpoints"] = ["vllm:8000", "127.0.0.1:8000", "10.0.0.1", "[::1]:80",
                                     "::1:8001"]
    found = check_problems(write(tmp_path, data), capsys)
    assert [p.split(":")[0] for p in found] == ["pools[0].endpoints[0]", "pools[0].endpoints[2]",
                                                "pools[0].endpoints[4]"]
    assert found[2].endswith("write an IPv6 address in brackets, [::1]:8001")  # as Envoy reads
    # a destination and a URL holds it: unbracketed, it was accepted and routed nowhere


def test_files_the_config_names_are_checked(tmp_path, capsys):
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["pools"][0]["models"] = [{"name": "m", "tokenizer": str(tmp_path / "tokenizer.json")}]
    data["tenants"][0]["tier"] = "nope"
    path = write(tmp_path, data)
    found = check_problems(path, capsys)
    assert f"pools[0].models[0].tokenizer: cannot read {tmp_path}/tokenizer.json: no such file" \
        in found
    assert any(p.startswith("tenants[0].tier: unknown tier") for p in found)
    assert len(check_problems(path, capsys, "--skip-files")) == 1
    (tmp_path / "tokenizer.json").write_text("{}")
    data["tenants"][0]["tier"] = "gold"
    assert main(["check", str(write(tmp_path, data))]) == 0


def test_a_file_name_too_long_is_that_keys_problem(tmp_path, capsys):
    """A path the kernel refuses to look up (ENAMETOOLONG) raised from ``exists()``: check
    printed `kvgate check: File name too long: aaa…`, naming neither the file nor the key,
    and stopped there (the unknown tier beside it went unreported)."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["pools"][0]["models"] = [{"name": "m", "tokenizer": "a" * 300}]
    data["tenants"][0]["tier"] = "nope"
    found = check_problems(write(tmp_path, data), capsys)
    assert f"pools[0].models[0].tokenizer: cannot read {'a' * 300}: File name too long" in found
    assert any(p.startswith("tenants[0].tier: unknown tier") for p in found)


def test_serve_names_the_file_and_every_unreadable_tls_file(tmp_path, capsys):
    """`kvgate serve` with server.tls files missing printed "server.tls: 1 problem(s)" and
    "cert_file: cannot read …": the config file unnamed, the key file's problem unsaid."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["server"] = {"grpc_port": free_port(), "admin_port": free_port(),
                      "tls": {"cert_file": str(tmp_path / "no.pem"),
                              "key_file": str(tmp_path / "no.key")}}
    path = write(tmp_path, data)
    assert main(["serve", "-c", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{path}: 2 problem(s)", err
    assert [line.strip() for line in err[1:]] == [
        f"server.tls.cert_file: cannot read {tmp_path}/no.pem: No such file or directory",
        f"server.tls.key_file: cannot read {tmp_path}/no.key: No such file or directory"]


def test_serve_with_workers_reports_start_up_secrets_and_tls_once(tmp_path, capsys,
                                                                 monkeypatch):
    """`serve --workers 2` with an unset upstream_api_key variable or a missing TLS file:
    each worker raised its own ConfigError traceback, and the parent exited 1."""
    monkeypatch.delenv("KVGATE_TEST_NO_SUCH_KEY", raising=False)
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["pools"][0]["upstream_api_key"] = {"env": "KVGATE_TEST_NO_SUCH_KEY"}
    data["redis"] = {"url": "redis://127.0.0.1:1", "replicas": 2}
    data["server"] = {"grpc_port": free_port(), "admin_port": consecutive_free_ports(2),
                      "tls": {"cert_file": str(tmp_path / "no.pem"),
                              "key_file": str(tmp_path / "no.key")}}
    path = write(tmp_path, data)
    assert main(["serve", "-c", str(path), "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"{path}: 3 problem(s)",
        "  pools[0].upstream_api_key: environment variable KVGATE_TEST_NO_SUCH_KEY is empty "
        "or not set",
        f"  server.tls.cert_file: cannot read {tmp_path}/no.pem: No such file or directory",
        f"  server.tls.key_file: cannot read {tmp_path}/no.key: No such file or directory"]


def test_a_duplicate_rls_descriptor_is_reported_beside_a_broken_sibling(tmp_path, capsys):
    # pydantic checks a list for duplicates only once every entry is valid: fixing the
    # unit uncovered the duplicate, one deploy cycle later
    def rule(key, **limit):
        return {"key": key, "rate_limit": {"unit": "second", "requests_per_unit": 1, **limit}}

    data = {**GOOD, "ratelimit": {"domains": [
        {"domain": "d", "descriptors": [
            rule("a"), rule("b", unit="fortnight"), rule("a"),
            {"key": "n", "descriptors": [rule("x", burst=0), rule("x")]}]},
        {"domain": "d"}]}}
    assert check_problems(write(tmp_path, data), capsys) == [
        "ratelimit.domains[0].descriptors[1].rate_limit.unit: Input should be 'second', "
        "'minute', 'hour', 'day', 'week', 'month' or 'year'",
        "ratelimit.domains[0].descriptors[3].descriptors[0].rate_limit.burst: Input should "
        "be greater than 0",
        "ratelimit.domains: duplicate domain 'd'",
        "ratelimit.domains[0].descriptors: duplicate descriptor: key 'a' with any value",
        "ratelimit.domains[0].descriptors[3].descriptors: duplicate descriptor: key 'x' with "
        "any value",
    ]
    # with the fields fixed: the same three, those pydantic finds itself not repeated
    data["ratelimit"]["domains"][0]["descriptors"][1] = rule("b")
    data["ratelimit"]["domains"][0]["descriptors"][3]["descriptors"][0] = rule("x")
    assert check_problems(write(tmp_path, data), capsys) == [
        "ratelimit.domains[0].descriptors[3].descriptors: duplicate descriptor: key 'x' with "
        "any value",
        "ratelimit.domains: duplicate domain 'd'",
        "ratelimit.domains[0].descriptors: duplicate descriptor: key 'a' with any value"]


def test_upstream_api_keys_are_checked_as_serve_reads_them(tmp_path, capsys, monkeypatch):
    # `kvgate check` said OK, then `kvgate serve` refused the config as "<config>"
    monkeypatch.delenv("KVGATE_TEST_UPSTREAM_KEY", raising=False)
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    empty = tmp_path / "empty.key"
    empty.write_text("\n")
    data["pools"] += [
        {"name": f"p{i}", "models": [f"m{i}"], "endpoints": [f"127.0.0.{i + 2}:8000"],
         "upstream_api_key": secret}
        for i, secret in enumerate([{"env": "KVGATE_TEST_UPSTREAM_KEY"}, {"file": str(empty)},
                                    {"file": str(tmp_path / "missing.key")}])]
    path = write(tmp_path, data)
    assert check_problems(path, capsys) == [
        f"pools[3].upstream_api_key.file: cannot read {tmp_path}/missing.key: no such file",
        "pools[1].upstream_api_key: environment variable KVGATE_TEST_UPSTREAM_KEY is empty "
        "or not set",
        f"pools[2].upstream_api_key: {empty} is empty or not set",
    ]
    assert main(["check", "--skip-files", str(path)]) == 0
    data["pools"] = data["pools"][:2]
    data["server"] = {"grpc_port": 0, "admin_port": None}
    done = kvgate("serve", "--config", str(write(tmp_path, data)))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"{tmp_path}/kvgate.yaml: 1 problem(s)",
        "  pools[1].upstream_api_key: environment variable KVGATE_TEST_UPSTREAM_KEY is empty "
        "or not set"]
    monkeypatch.setenv("KVGATE_TEST_UPSTREAM_KEY", "sk-engine")
    assert main(["check", str(path)]) == 0


def test_yaml_errors_name_the_file_and_line(tmp_path):
    path = write(tmp_path, "tiers:\n  gold: {}\n bad: 1\n")
    done = kvgate("check", str(path))
    assert done.returncode == 2 and "<unicode string>" not in done.stderr
    assert done.stderr.splitlines() == [
        f"{path}: 1 problem(s)",
        "  line 3, column 2: not valid YAML: expected <block end>, but found "
        "'<block mapping start>'",
    ]


def test_a_control_character_is_one_line_naming_where(tmp_path):
    # PyYAML's reader error was two lines, the second naming "<unicode string>"
    path = tmp_path / "kvgate.yaml"
    path.write_bytes(b"tiers: {}\x00\n")
    done = kvgate("check", str(path))
    assert done.returncode == 2 and "<unicode string>" not in done.stderr
    assert done.stderr.splitlines() == [
        f"{path}: 1 problem(s)",
        "  character 10: not valid YAML: special characters are not allowed #x0000"]


def test_the_bundled_config_checks_clean():
    done = kvgate("check", str(EXAMPLE_CONFIG))
    assert done.returncode == 0 and "OK" in done.stdout


# -- one line for bad input, never a traceback --------------------------------------------------


def test_a_closed_stdout_is_no_traceback():
    """Started with stdout closed (``>&-``), Python has no sys.stdout at all: render-envoy
    printed a traceback instead of its output going nowhere."""
    done = subprocess.run([sys.executable, "-m", "extproc.cli", "render-envoy",
                           str(EXAMPLE_CONFIG)], stdin=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=60,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


def test_hash_key_without_input_is_one_line_not_eoferror():
    line = one_line_error(kvgate("hash-key"))
    assert "no key given" in line


def test_hash_key_reads_a_piped_key():
    done = kvgate("hash-key", stdin="sk-piped\n")
    assert done.returncode == 0 and done.stdout.strip() == hash_api_key("sk-piped")


def test_serve_on_a_port_in_use_is_one_line(tmp_path, taken):
    data = {**GOOD, "server": {"grpc_port": taken, "admin_port": 0}}
    line = one_line_error(kvgate("serve", "--config", str(write(tmp_path, data))))
    assert line == f"kvgate serve: server.grpc_port: 127.0.0.1:{taken} is already in use"


def test_serve_and_render_on_a_missing_file_are_one_line(tmp_path):
    for verb in (["serve", "--config"], ["render-envoy"], ["demo", "--config"]):
        done = kvgate(*verb, str(tmp_path / "missing.yaml"))
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert "cannot read: No such file or directory" in done.stderr


def test_a_config_that_is_not_utf8_is_one_problem_not_a_traceback(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_bytes(b"tiers: {}\n\xff\xfe\n")
    for verb in (["check"], ["serve", "--config"], ["render-envoy"]):
        done = kvgate(*verb, str(path))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines() == [f"{path}: 1 problem(s)",
                                            "  cannot read: not UTF-8 text (byte 10)"]


def test_render_envoy_to_an_unwritable_place_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    line = one_line_error(kvgate("render-envoy", str(EXAMPLE_CONFIG), "-o",
                                 str(tmp_path / "file" / "envoy.yaml")))
    assert line.startswith("kvgate render-envoy: ") and str(tmp_path / "file") in line


def test_a_config_too_deep_or_too_large_is_one_problem_for_every_verb(tmp_path):
    deep = write(tmp_path, "tiers: " + "[" * 500 + "]" * 500 + "\n")
    for verb in (["check"], ["serve", "--config"], ["render-envoy"]):
        done = kvgate(*verb, str(deep))
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines() == [
            f"{deep}: 1 problem(s)",
            "  line 1, column 107: nested too deeply (more than 100 levels)"]
    done = kvgate("check", "/dev/zero", timeout=20)  # was a MemoryError after all memory
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines() == [
        "/dev/zero: 1 problem(s)", "  larger than 8 MiB, too large for a config"]


def test_a_fifo_nothing_writes_to_is_refused_not_waited_on_forever(tmp_path, capsys,
                                                                   monkeypatch):
    # `kvgate check FIFO`, `import-ratelimit FIFO` and a FIFO as upstream_api_key.file
    # blocked in open() until something wrote to it: forever
    monkeypatch.setattr("extproc.yaml_input.FIFO_WAIT_S", 0.2)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert check_problems(fifo, capsys) == ["cannot read: a pipe nothing wrote to within 0.2 s"]
    assert main(["import-ratelimit", str(fifo)]) == 2
    assert capsys.readouterr().err == (
        f"kvgate import-ratelimit: {fifo}: cannot read: a pipe nothing wrote to within 0.2 s\n")
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["pools"][0]["upstream_api_key"] = {"file": str(fifo)}
    with pytest.raises(ConfigError) as error:
        upstream_authorizations(parse_config(data, "kvgate.yaml"))
    assert error.value.problems == [
        f"pools[0].upstream_api_key: cannot read {fifo}: a pipe nothing wrote to within 0.2 s"]


def test_a_config_read_from_a_pipe_that_writes_is_read(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: (time.sleep(0.3),
                                              fifo.write_text(yaml.safe_dump(GOOD))))
    writer.start()
    assert main(["check", str(fifo)]) == 0
    writer.join()
    assert capsys.readouterr().out.startswith(f"{fifo}: OK")


def test_check_reports_duplicate_keys_with_the_other_problems(tmp_path, capsys):
    text = yaml.safe_dump(GOOD) + "tiers: {silver: {}}\n"
    assert check_problems(write(tmp_path, text), capsys) == [
        "tiers: duplicate key at line 16, column 1 (first at line 12, column 1; YAML would "
        "keep only the last)",
        "tenants[0].tier: unknown tier 'gold' (known: silver)",  # the second one won
    ]


# -- render-envoy -o: what the user's path is ---------------------------------------------------


def render_to(out: Path) -> str:
    assert main(["render-envoy", str(EXAMPLE_CONFIG), "-o", str(out)]) == 0
    return out.read_text() if out.is_file() else ""


def test_render_envoy_keeps_a_symlink_and_replaces_its_target(tmp_path):
    target, link = tmp_path / "real" / "envoy.yaml", tmp_path / "envoy.yaml"
    target.parent.mkdir()
    target.write_text("old")
    link.symlink_to(target)
    assert render_to(link).startswith("# Envoy bootstrap")
    assert link.is_symlink() and target.read_text().startswith("# Envoy bootstrap")
    assert sorted(p.name for p in target.parent.iterdir()) == ["envoy.yaml"]  # no temp left
    dangling = tmp_path / "new.yaml"
    dangling.symlink_to(tmp_path / "real" / "new.yaml")
    render_to(dangling)
    assert dangling.is_symlink() and (tmp_path / "real" / "new.yaml").is_file()


def test_render_envoy_keeps_the_files_permissions(tmp_path):
    out = tmp_path / "envoy.yaml"
    out.write_text("old")
    out.chmod(0o640)
    render_to(out)
    assert out.stat().st_mode & 0o777 == 0o640
    fresh = tmp_path / "fresh.yaml"
    umask = os.umask(0o027)
    try:
        render_to(fresh)
    finally:
        os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o640  # 0o666 less the umask, as open() makes it


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may give a file to another user")
def test_render_envoy_keeps_the_files_owner(tmp_path):
    out = tmp_path / "envoy.yaml"
    out.write_text("old")
    os.chown(out, 65534, 65534)  # nobody: root renders what an unprivileged Envoy reads
    out.chmod(0o640)
    render_to(out)
    assert (out.stat().st_uid, out.stat().st_gid) == (65534, 65534)
    assert out.stat().st_mode & 0o777 == 0o640


def test_render_envoy_writes_into_a_fifo_without_replacing_it(tmp_path):
    fifo = tmp_path / "envoy.fifo"
    os.mkfifo(fifo)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_bytes()), daemon=True)
    reader.start()
    render_to(fifo)
    reader.join(timeout=10)
    assert read and read[0].startswith(b"# Envoy bootstrap")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["envoy.fifo"]


def test_render_envoy_refuses_to_write_over_its_own_config(tmp_path):
    # it replaced the config with the bootstrap, and said "wrote"
    config = write(tmp_path, GOOD)
    (tmp_path / "link.yaml").symlink_to(config)
    (tmp_path / "hard.yaml").hardlink_to(config)
    for output in (config, tmp_path / "link.yaml", tmp_path / "hard.yaml"):
        line = one_line_error(kvgate("render-envoy", str(config), "-o", str(output)))
        assert line == (f"kvgate render-envoy: -o {output} is the config file itself: the "
                        "bootstrap would replace it")
        assert yaml.safe_load(config.read_text()) == GOOD


def test_render_envoy_to_a_directory_names_it(tmp_path):
    line = one_line_error(kvgate("render-envoy", str(EXAMPLE_CONFIG), "-o", str(tmp_path)))
    assert line == f"kvgate render-envoy: Is a directory: {tmp_path}"
    assert list(tmp_path.iterdir()) == []


def test_render_envoy_refuses_a_port_it_cannot_name_and_warns_of_a_tls_mismatch(tmp_path):
    """grpc_port 0 rendered an ext_proc cluster on port 0 (Envoy accepted it; every request
    then failed), and TLS on one side only rendered without a word."""
    data = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    data["server"] = {**data.get("server", {}), "grpc_port": 0}
    path = tmp_path / "any-port.yaml"
    path.write_text(yaml.safe_dump(data))
    done = kvgate("render-envoy", str(path))
    assert done.returncode == 2 and "server.grpc_port: 0 (any free port)" in done.stderr
    data["server"]["grpc_port"] = 9001
    data["envoy"] = {**data.get("envoy", {}), "ext_proc_tls": {"ca_file": "/etc/ca.pem"}}
    path.write_text(yaml.safe_dump(data))
    done = kvgate("render-envoy", str(path))
    assert done.returncode == 0 and "/etc/ca.pem" in done.stdout
    assert "warning: " in done.stderr and "Envoy would speak TLS to kvgate's plaintext port" \
        in done.stderr


def test_render_envoy_refuses_full_duplex_for_its_own_bootstrap(tmp_path):
    data = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    data["server"] = {**data.get("server", {}), "body_mode": "full_duplex"}
    path = tmp_path / "duplex.yaml"
    path.write_text(yaml.safe_dump(data))
    done = kvgate("render-envoy", str(path))
    assert done.returncode == 2 and "server.body_mode: full_duplex" in done.stderr
    gie = kvgate("render-envoy", "--gie", str(path))
    assert gie.returncode == 0 and "FULL_DUPLEX_STREAMED" in gie.stdout


def test_agent_on_a_port_in_use_is_one_line(taken):
    line = one_line_error(kvgate("agent", "--host", "127.0.0.1", "--port", str(taken)))
    assert "already in use" in line


@pytest.mark.parametrize("port", ["70000", "-1", "abc"])
def test_agent_port_outside_0_to_65535_is_a_usage_error(port):
    # 70000 was an OverflowError traceback from bind() and exit 1
    done = kvgate("agent", "--host", "127.0.0.1", f"--port={port}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"kvgate agent: error: argument --port: {port} is not a port (0 to 65535)")


def test_worker_ports_past_65535_are_refused(tmp_path):
    # admin_port + i past 65535 was an OverflowError traceback from the free-port check
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["redis"] = {"url": "redis://127.0.0.1:1", "replicas": 4}
    data["server"] = {"grpc_port": 0, "admin_port": 65534, "report_port": 0}
    line = one_line_error(kvgate("serve", "-c", str(write(tmp_path, data)), "--workers", "4"))
    assert line == ("--workers 4: server.admin_port + 3 is port 65537, past 65535 (each worker "
                    "i listens on admin_port + i and report_port + i); lower it or run fewer "
                    "workers")


def test_agent_reads_a_file_of_its_own_section_alone(tmp_path, taken):
    """A GPU node's agent needs no tiers, tenants or pools (nor the tenants' key hashes):
    its file was refused for lacking them, so ``agent.port`` could only be set from the
    gateway's whole config. The section is still checked."""
    path = write(tmp_path, {"agent": {"host": "127.0.0.1", "port": taken}})
    assert "already in use" in one_line_error(kvgate("agent", "-c", str(path)))
    broken = write(tmp_path, {"agent": {"port": 99999}}, "broken.yaml")
    done = kvgate("agent", "-c", str(broken))
    assert done.returncode == 2 and "agent.port" in done.stderr, done.stderr


# -- --version and --help ---------------------------------------------------------------------


def test_version_and_a_clean_help():
    version = kvgate("--version")
    assert version.returncode == 0 and version.stdout.startswith("kvgate ")
    help_text = kvgate("--help").stdout
    assert "``" not in help_text and ":class:" not in help_text
    for verb in ("serve", "check", "hash-key", "render-envoy", "agent", "demo"):
        assert f"    {verb} " in help_text
    demo_help = " ".join(kvgate("demo", "--help").stdout.split())
    assert "envoy.listen_port" in demo_help and "server.grpc_port" in demo_help
    assert "pools[].endpoints" in demo_help


# -- the demo ---------------------------------------------------------------------------------


def demo_config(tmp_path: Path, **extra: object) -> Path:
    engines = [f"127.0.0.1:{free_port()}"]
    return write(tmp_path, {
        **GOOD, **extra,
        "server": {"grpc_port": free_port(), "admin_port": free_port()},
        "envoy": {"listen_port": free_port(), "admin_port": free_port()},
        "pools": [{"name": "p", "models": ["m"], "endpoints": engines}],
    })


def test_the_demo_prints_only_keys_its_config_accepts(tmp_path):
    bundled = load_config(EXAMPLE_CONFIG)
    assert known_keys(bundled) == {"acme": DEMO_KEYS["acme"], "globex": DEMO_KEYS["globex"],
                                   "hobbyist": DEMO_KEYS["hobbyist"]}
    assert known_keys(parse_config(GOOD)) == {}
    redis = parse_config({**GOOD, "redis": {"url": "redis://:secret@10.1.2.3:6379/0"}})
    assert _limits_line(redis) == "limits in Redis at 10.1.2.3:6379"
    assert _limits_line(parse_config(GOOD)) == "in-memory limits"


def test_the_demo_names_each_pools_engine_kind():
    sglang = {"name": "s", "models": ["n"], "engine": "sglang",
              "endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}
    assert _engines_line(parse_config(GOOD)) == "1 simulated vLLM engine(s)"
    both = parse_config({**GOOD, "pools": [*GOOD["pools"], sglang]})
    assert _engines_line(both) == ("1 simulated vLLM engine(s) and "
                                   "2 simulated SGLang engine(s)")


def demo_output(proc: subprocess.Popen[str]) -> str:
    """What a demo printed up to "Ctrl-C to stop." (or until it ended, or a minute)."""
    out = ""
    deadline = time.monotonic() + 60
    while "Ctrl-C" not in out and time.monotonic() < deadline and proc.poll() is None:
        out += proc.stdout.readline()  # type: ignore[union-attr]
    return out


def start_demo(path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "extproc.cli", "demo", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_demo_on_a_config_of_ones_own(tmp_path):
    """Started for real: it says it cannot know the keys, and offers a curl line that does
    not carry the bundled ones."""
    path = demo_config(tmp_path)
    proc = start_demo(path)
    try:
        out = demo_output(proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert "stores only hashes" in out and "$KVGATE_API_KEY" in out, out
    assert "sk-demo" not in out and "in-memory limits" in out
    assert "starting 1 simulated vLLM engine(s)" in out


def test_a_demo_sigtermed_while_starting_leaves_no_engine_behind(tmp_path):
    """SIGTERM as soon as its engine answers (kvgate and Envoy still starting): the demo
    stops what it started. Its handler was set only after "Ctrl-C to stop.", so this
    killed the demo and left the engine holding its port."""
    path = demo_config(tmp_path)
    engine = yaml.safe_load(path.read_text())["pools"][0]["endpoints"][0]
    host, port = engine.rsplit(":", 1)
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "demo", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex((host, int(port))) == 0

    try:
        deadline = time.monotonic() + 60
        while not listening() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert listening()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while listening() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not listening(), f"an engine still answers on {engine}"


def test_a_demo_stops_on_sighup_and_leaves_no_engine_behind(tmp_path):
    """SIGHUP (a closed terminal, or a reload meant for `kvgate serve`) stops the demo as
    SIGTERM does; its default killed the demo at once and left an engine on its port."""
    path = demo_config(tmp_path)
    host, port = yaml.safe_load(path.read_text())["pools"][0]["endpoints"][0].rsplit(":", 1)
    proc = start_demo(path)
    try:
        out = demo_output(proc)
        assert "Ctrl-C" in out, out
    finally:
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=30) == 0

    def listening() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex((host, int(port))) == 0

    deadline = time.monotonic() + 10
    while listening() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not listening(), f"an engine still answers on {host}:{port}"


def test_a_demo_stopped_lets_an_open_stream_finish(tmp_path):
    """As `kvgate serve` drains: the demo's own teardown stopped Envoy first, which cut every
    answer still streaming (a fault audit: 14 requests cut)."""
    import httpx

    path = demo_config(tmp_path)
    port = yaml.safe_load(path.read_text())["envoy"]["listen_port"]
    proc = start_demo(path)
    lines: list[str] = []
    try:
        out = demo_output(proc)
        assert "Ctrl-C" in out, out
        body = {"model": "m", "max_tokens": 150, "stream": True,
                "messages": [{"role": "user", "content": "hello"}]}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                          headers={"authorization": "Bearer sk-mine"}, timeout=30) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                if line.startswith("data:") and not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                lines.append(line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]


def test_a_demo_started_with_sigint_ignored_still_stops_on_sigint(tmp_path):
    """A background job of a shell script starts with SIGINT ignored; a SIGINT to the demo
    must still stop it (its engines and Envoy stop on one either way)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc.cli", "demo", "--config", str(demo_config(tmp_path))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        out = demo_output(proc)
        assert "Ctrl-C" in out, out
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:  # SIGTERM stops what it started (the test above)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_smoke_refuses_a_config_without_the_demo_keys(tmp_path):
    line = one_line_error(kvgate("demo", "--smoke", "--config", str(demo_config(tmp_path))))
    assert "--smoke sends the bundled demo keys" in line


def test_a_demo_port_in_use_is_one_line(tmp_path, taken):
    path = demo_config(tmp_path, envoy={"listen_port": taken})
    data = yaml.safe_load(path.read_text())
    data["envoy"]["listen_port"] = taken
    line = one_line_error(kvgate("demo", "--config", str(write(tmp_path, data))))
    assert line == f"kvgate demo: envoy.listen_port: 127.0.0.1:{taken} is already in use"


def test_an_engine_port_another_engine_answers_is_not_taken_for_ours():
    """A second demo must not report the first one's engines as its own."""
    with EngineProcess() as first:
        with pytest.raises(PortInUse, match=f"{first.port} is already in use"):
            EngineProcess(port=first.port).start()
        assert first.state()["pid"] == first.proc.pid  # type: ignore[union-attr]


def test_each_worker_takes_its_own_report_port_and_ranges_that_meet_are_refused(tmp_path,
                                                                               capsys):
    """A fixed report_port was bound by every worker: all but one died at start
    (address in use), and their requests' reports had nowhere to go."""
    from extproc.config import for_worker

    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["redis"] = {"url": "redis://127.0.0.1:1", "replicas": 2}
    data["server"] = {"grpc_port": 9001, "admin_port": 9002, "report_port": 9003}
    config = parse_config(data)
    second = for_worker(config, 1).server
    assert (second.grpc_port, second.admin_port, second.report_port) == (9001, 9003, 9004)
    assert for_worker(config, 0) is config
    assert main(["serve", "-c", str(write(tmp_path, data)), "--workers", "2"]) == 2
    assert ("--workers 2: server.report_port and server.admin_port both take port 9003"
            in capsys.readouterr().err)
    data["server"]["report_port"], data["server"]["admin_port"] = 0, 0  # any free ports
    assert for_worker(parse_config(data), 3).server.report_port == 0


@pytest.mark.parametrize("setting", ["admin_port", "report_port"])
def test_a_worker_port_that_meets_the_grpc_port_is_refused(setting):
    """admin_port + 1 (or report_port + 1) on the gRPC port passed the free-port check:
    worker 1 died at start (address in use) with a traceback, and serve exited 1."""
    from extproc.cli import _port_overlap

    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["redis"] = {"url": "redis://127.0.0.1:1"}
    data["server"] = {"grpc_port": 9001, "admin_port": 9100, "report_port": 9200,
                      setting: 9000}
    config = parse_config(data)
    assert _port_overlap(config, 2) == (
        f"--workers 2: server.grpc_port and server.{setting} both take port 9001 (each "
        "worker i listens on admin_port + i and report_port + i); move one of them further "
        "apart")
    assert _port_overlap(config, 1) is None  # one worker: 9000 is its own


@pytest.mark.parametrize("setting", ["admin_port", "report_port"])
def test_one_port_for_two_of_kvgates_listeners_is_a_config_problem(tmp_path, capsys, setting):
    """The same port for the gRPC and admin (or report) port passed `kvgate check`, then
    `kvgate serve` refused the file with "--workers 1: … both take port", though no
    --workers was given. Two distinct specific addresses may share a port number."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["server"] = {"grpc_port": 9001, setting: 9001}
    path = write(tmp_path, data)
    assert check_problems(path, capsys) == [
        f"server: {setting} 9001 is grpc_port too: kvgate listens on each of them, so it "
        "could not start; give each its own port"]
    assert main(["serve", "-c", str(path)]) == 2
    assert f"server: {setting} 9001 is grpc_port too" in capsys.readouterr().err
    data["server"] = {"grpc_port": 9001, "admin_port": 9001, "host": "0.0.0.0"}
    assert len(check_problems(write(tmp_path, data), capsys)) == 1
    data["server"] = {"grpc_port": 9001, "admin_port": 9001, "host": "10.0.0.1",
                      "admin_host": "127.0.0.1"}
    parse_config(data)  # apart: two addresses
    data["server"] = {"grpc_port": 0, "admin_port": 0, "report_port": 0}
    parse_config(data)  # any free ports


def test_workers_need_redis_replicas_to_count_them(tmp_path, capsys):
    """``replicas: 1`` with 4 workers: under the local policy each worker enforced the whole
    limit while Redis was unreachable, four times it in all."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["redis"] = {"url": "redis://127.0.0.1:1"}
    assert main(["serve", "-c", str(write(tmp_path, data)), "--workers", "4"]) == 2
    assert ("redis.replicas is 1, but it counts every process sharing the limits"
            in capsys.readouterr().err)
    from extproc.cli import _replicas_below_workers

    data["redis"]["failure_policy"] = "fail_closed"  # no share to get wrong
    assert _replicas_below_workers(parse_config(data), 4) is None
    data["redis"] |= {"failure_policy": "local", "replicas": 4}
    assert _replicas_below_workers(parse_config(data), 4) is None


def _sighup_ignored(pid: int) -> bool:
    """Whether the process ignores SIGHUP (``SigIgn`` in /proc: signal 1 is bit 0)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(status.split("SigIgn:")[1].split()[0], 16) & 1)


def test_a_sighup_while_serve_starts_does_not_end_it(tmp_path):
    """No handler was installed until the server ran: a reload sent while it started (a
    ConfigMap update, a script) ended the process with SIGHUP's default action. The config
    is a FIFO here, so the process waits at its first read, mid-start, for as long as the
    test needs."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    data["server"] = {"grpc_port": 0, "admin_port": 0, "report_port": 0, "reload_poll_s": 0}
    fifo = tmp_path / "kvgate.yaml"
    os.mkfifo(fifo)
    log = tmp_path / "serve.log"
    process = subprocess.Popen([sys.executable, "-m", "extproc.cli", "serve", "-c", str(fifo)],
                               stdout=subprocess.DEVNULL, stderr=log.open("wb"),
                               env={**os.environ, "KVGATE_NATIVE": "0"})
    try:
        deadline = time.monotonic() + 30
        while not _sighup_ignored(process.pid):  # its first lines ran: it reads its config
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert process.poll() is None
        with open(fifo, "w") as writer:  # what `serve` reads; then its worker reads a file
            fifo.unlink()
            fifo.write_text(yaml.safe_dump(data))
            writer.write(yaml.safe_dump(data))
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# The `kvgate` script as installed (`[project.scripts]`), run by an interpreter that has
# finished its own start: SIGHUP reset to its default action (a test runner may ignore it),
# then one byte on the pipe named first just before the script's first line runs.
_SCRIPT_HARNESS = (
    "import os, pkgutil, runpy, signal, sys\n"
    "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n"
    "ready, script = int(sys.argv[1]), sys.argv[2]\n"
    "sys.argv = sys.argv[2:]\n"
    "os.write(ready, b'r')\n"
    "os.close(ready)\n"
    "runpy.run_path(script, run_name='__main__')\n"
)


def _answers(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.05).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigint_while_the_kvgate_command_imports_is_status_130_without_a_traceback(
        tmp_path):
    """Ctrl-C in the first ~0.2 s of `kvgate serve` (the imports, before main() catches
    KeyboardInterrupt) printed a traceback from whichever module it landed in."""
    script = Path(sys.executable).with_name("kvgate")
    if not script.exists():
        pytest.skip("no installed `kvgate` script beside this interpreter")
    config = write(tmp_path, GOOD)
    ready, signal_fd = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT_HARNESS, str(signal_fd), str(script), "serve", "-c",
         str(config)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, pass_fds=(signal_fd,),
        env={**os.environ, "KVGATE_NATIVE": "0"})
    os.close(signal_fd)
    assert os.read(ready, 1) == b"r"
    time.sleep(0.05)  # past the harness's last lines, well within the imports (~0.2 s)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_every_5_ms_from_the_start_of_kvgate_serve_does_not_end_it(tmp_path, workers):
    """A config-management tool that reloads right after it starts `kvgate serve`: SIGHUP
    every 5 ms from when the interpreter runs the `kvgate` script's first line until
    every process serves (workers too, which start later: the parent forwards each
    SIGHUP to them). The signal's default action ended the process until main() ignored
    it, after ~0.2 s of imports; the script now ignores it first thing (kvgate_cli.py).
    Then the real handler is in place: one more SIGHUP reloads the file. (The
    interpreter's own start, before any line of the script, is beyond a Python program's
    reach: there this test's harness, not kvgate, has SIGHUP's default action.)"""
    script = Path(sys.executable).with_name("kvgate")
    if not script.exists():
        pytest.skip("no installed `kvgate` script beside this interpreter")
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    admin = consecutive_free_ports(workers)
    data["server"] = {"grpc_port": free_port(), "admin_port": admin,
                      "report_port": consecutive_free_ports(workers), "reload_poll_s": 0}
    if workers > 1:
        data["redis"] = {"url": "redis://127.0.0.1:1",  # never reached: the pool is idle
                         "replicas": workers}
    config = write(tmp_path, data)
    log = tmp_path / "serve.log"
    ready, signal_fd = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT_HARNESS, str(signal_fd), str(script), "serve", "-c",
         str(config),
         "--workers", str(workers)],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"), pass_fds=(signal_fd,),
        env={**os.environ, "KVGATE_NATIVE": "0"})
    os.close(signal_fd)
    try:
        assert os.read(ready, 1) == b"r", log.read_text()
        sent, deadline = 0, time.monotonic() + 60
        while not all(_answers(admin + i) for i in range(workers)) or sent < 200:
            for _ in range(20):  # every 5 ms, checking that it serves every 0.1 s
                time.sleep(0.005)
                assert process.poll() is None, (
                    f"ended by SIGHUP number {sent} ({process.returncode}):\n{log.read_text()}")
                process.send_signal(signal.SIGHUP)
                sent += 1
            assert time.monotonic() < deadline, log.read_text()
        reloads = log.read_text().count("config reloaded (SIGHUP)")
        process.send_signal(signal.SIGHUP)
        assert wait_for(lambda: log.read_text().count("config reloaded (SIGHUP)")
                        >= reloads + workers, 10), log.read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()
    finally:
        os.close(ready)
        if process.poll() is None:
            process.kill()
            process.wait()


def _sleep_forever() -> None:
    import signal as signals

    signals.signal(signals.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(600)


def test_a_worker_that_dies_stops_the_others_and_fails_the_parent():
    """The parent never noticed a worker dying: it served on with fewer workers, logged
    nothing, and exited 0 (a negative exit code read as 0)."""
    import multiprocessing

    from extproc.cli import _watch_workers

    context = multiprocessing.get_context("spawn")
    ready = [context.Value("b", 0, lock=False) for _ in range(2)]
    workers = [context.Process(target=_sleep_forever, args=(ready[i],), name=f"w{i}")
               for i in range(2)]
    for worker in workers:
        worker.start()
    # (spawned: the interpreter starts first, seconds on a busy machine; a SIGTERM before
    # the handler is in place ends a worker by its default action)
    assert wait_for(lambda: all(flag.value for flag in ready), 30)
    os.kill(workers[0].pid, signal.SIGKILL)
    assert _watch_workers(workers, lambda: False) == 1
    assert workers[0].exitcode == -signal.SIGKILL and workers[1].exitcode == 0


def _beat_forever(beat: object) -> None:
    import signal as signals

    signals.signal(signals.SIGTERM, lambda *_: sys.exit(0))
    while True:
        beat.value = time.monotonic()  # type: ignore[attr-defined]
        time.sleep(0.05)


def test_a_stuck_worker_is_killed_and_fails_the_parent():
    """A worker whose event loop stopped turning (here: SIGSTOP) answered nothing, yet the
    pod's liveness probe asks worker 0 only: it was never restarted. The parent kills it
    once its heartbeat is ``stall_s`` old, and then stops the others and exits 1."""
    import multiprocessing

    from extproc.cli import _watch_workers

    context = multiprocessing.get_context("spawn")
    beats = [context.Value("d", 0.0, lock=False) for _ in range(2)]
    workers = [context.Process(target=_beat_forever, args=(beats[i],), name=f"w{i}")
               for i in range(2)]
    for worker in workers:
        worker.start()
    assert wait_for(lambda: all(beat.value for beat in beats), 30)
    os.kill(workers[1].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    assert _watch_workers(workers, lambda: False, beats, stall_s=1.0) == 1
    assert 1.0 <= time.monotonic() - stopped < 5.0
    assert workers[1].exitcode == -signal.SIGKILL and workers[0].exitcode == 0


def _sleep_forever(ready: object = None) -> None:
    import signal as signals

    signals.signal(signals.SIGTERM, lambda *_: sys.exit(0))
    if ready is not None:
        ready.value = 1  # type: ignore[attr-defined]
    time.sleep(3600)


def test_a_worker_that_never_starts_serving_is_killed_and_fails_the_parent():
    """Worker 1 never writes its heartbeat (stuck while starting): the pod's startup probe
    passed on worker 0, so nothing else would restart it."""
    import multiprocessing

    from extproc.cli import _watch_workers

    context = multiprocessing.get_context("spawn")
    beats = [context.Value("d", 0.0, lock=False) for _ in range(2)]
    w1_ready = context.Value("b", 0, lock=False)
    workers = [context.Process(target=_beat_forever, args=(beats[0],), name="w0"),
               context.Process(target=_sleep_forever, args=(w1_ready,), name="w1")]
    for worker in workers:
        worker.start()
    # both interpreters up first (seconds on a busy machine): w0 then beats within start_s
    assert wait_for(lambda: beats[0].value and w1_ready.value, 30)
    started = time.monotonic()
    assert _watch_workers(workers, lambda: False, beats, stall_s=1.0, start_s=2.0) == 1
    assert 2.0 <= time.monotonic() - started < 10.0
    assert workers[1].exitcode == -signal.SIGKILL and workers[0].exitcode == 0


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(child) for task in tasks.iterdir()
            for child in (task / "children").read_text().split()]


def test_kvgate_serve_workers_exits_1_when_its_workers_never_start_serving(tmp_path):
    """Through ``kvgate serve --workers 2``, with the pool's tokenizer on a named pipe
    nobody writes (a file system that hangs on read): both workers block while starting,
    and the parent kills them after ``server.worker_start_s`` and exits 1."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    data["pools"][0]["models"] = [{"name": "m", "tokenizer": str(fifo)}]
    data["server"] = {"grpc_port": free_port(), "admin_port": consecutive_free_ports(2),
                      "report_port": consecutive_free_ports(2), "reload_poll_s": 0,
                      "worker_start_s": 5}
    data["redis"] = {"url": "redis://127.0.0.1:1", "replicas": 2}  # never reached
    config = write(tmp_path, data)
    log = tmp_path / "serve.log"
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "extproc.cli", "serve", "-c", str(config), "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, "KVGATE_NATIVE": "0"})
    try:
        assert process.wait(60) == 1, log.read_text()
        assert time.monotonic() - started >= 5.0
        assert "has not started serving in" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_kvgate_serve_workers_exits_1_when_a_worker_stops_turning(tmp_path):
    """Through ``kvgate serve --workers 2``: one worker SIGSTOPped (its event loop, and
    every probe it would answer, stuck) is killed after ``server.worker_stall_s`` and the
    parent exits 1 for the orchestrator to restart it."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    admin = consecutive_free_ports(2)
    data["server"] = {"grpc_port": free_port(), "admin_port": admin,
                      "report_port": consecutive_free_ports(2), "reload_poll_s": 0,
                      "worker_stall_s": 3}
    data["redis"] = {"url": "redis://127.0.0.1:1", "replicas": 2}  # never reached: idle
    config = write(tmp_path, data)
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "extproc.cli", "serve", "-c", str(config), "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, "KVGATE_NATIVE": "0"})
    try:
        assert wait_for(lambda: all(_answers(admin + i) for i in range(2)), 60), log.read_text()
        workers = [pid for pid in _children(process.pid)
                   if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2, workers
        time.sleep(3)  # serving, beating: nothing is killed
        assert process.poll() is None, log.read_text()
        os.kill(max(workers), signal.SIGSTOP)
        assert process.wait(30) == 1, log.read_text()
        assert "has not run for" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
