"""``kvgate import-ratelimit``: envoyproxy/ratelimit files become a ``ratelimit:`` section
kvgate loads; bad input is one clear line on stderr and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.cli import main
from extproc.config import RateLimitSettings
from tests.paths import REPO

IMPORTED = REPO / "tests" / "data" / "envoyproxy-ratelimit.yaml"


def imported_rule(path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> dict:
    """``text`` written to ``path`` and imported: its one descriptor rule, as printed."""
    path.write_text(text)
    assert main(["import-ratelimit", str(path)]) == 0
    [rule] = yaml.safe_load(capsys.readouterr().out)["ratelimit"]["domains"][0]["descriptors"]
    return rule


def test_prints_a_section_kvgate_loads(capsys):
    assert main(["import-ratelimit", str(IMPORTED)]) == 0
    out, err = capsys.readouterr()
    section = yaml.safe_load(out)["ratelimit"]
    settings = RateLimitSettings.model_validate(section)
    assert settings.domains[0].domain == "edge"
    canary = settings.domains[0].descriptors[-1]
    assert canary.shadow_mode and canary.rate_limit.unit == "minute"  # MINUTE lower-cased
    assert canary.rate_limit.algorithm == "fixed_window"
    assert "detailed_metric: dropped" in err


def test_several_files_and_another_algorithm(tmp_path: Path, capsys):
    other = tmp_path / "other.yaml"
    other.write_text("domain: other\ndescriptors:\n  - key: k\n    rate_limit:\n"
                     "      unit: hour\n      requests_per_unit: 7\n")
    assert main(["import-ratelimit", "--algorithm", "token_bucket", str(IMPORTED),
                 str(other)]) == 0
    domains = yaml.safe_load(capsys.readouterr().out)["ratelimit"]["domains"]
    assert [d["domain"] for d in domains] == ["edge", "other"]
    assert domains[1]["descriptors"][0]["rate_limit"]["algorithm"] == "token_bucket"


@pytest.mark.parametrize(("text", "problem"), [
    ("domain: [unclosed", "not valid YAML"),
    ("- just a list", "not an envoyproxy/ratelimit config"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limits: {}\n",
     "descriptors[0]: unknown key 'rate_limits'"),
    ("domain: d\ndescriptors:\n  - key: k\n    quota_mode: true\n",
     "descriptors[0].quota_mode: not supported by kvgate"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second}\n",
     "descriptors[0].rate_limit: give unit and requests_per_unit"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, "
     "requests_per_unit: 1}\n", "descriptors[0].rate_limit.unit"),
    # there only a trailing '*' is a wildcard: '*.example.com' matches that literal host
    ("domain: d\ndescriptors:\n  - key: host\n    value: '*.example.com'\n"
     "    rate_limit: {unit: second, requests_per_unit: 1}\n",
     "descriptors[0].value: '*.example.com': envoyproxy/ratelimit reads a '*' before the end"),
    # envoyproxy/ratelimit refuses these two as well
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: second}\n",
     "descriptors[0].rate_limit: unlimited: true takes no unit"),
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, "
     "name: a, replaces: [{name: a}]}\n", "replaces names this limit itself ('a')"),
    # a Go string holds neither: imported as "['a', 'b']", a value nothing matches
    ("domain: d\ndescriptors:\n  - key: k\n    value: [a, b]\n"
     "    rate_limit: {unit: second, requests_per_unit: 1}\n",
     "descriptors[0].value: expected a string, got a list"),
    ("domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: j\n"
     "        value: {a: 1}\n        rate_limit: {unit: second, requests_per_unit: 1}\n",
     "descriptors[0].descriptors[0].value: expected a string, got a mapping"),
    # it would switch nothing off: a typo
    ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, "
     "name: a}\n  - key: j\n    rate_limit: {unit: second, requests_per_unit: 1, "
     "replaces: [{name: b}]}\n", "replaces names 'b', which no limit of domain 'd' is called"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, text, problem):
    path = tmp_path / "rl.yaml"
    path.write_text(text)
    assert main(["import-ratelimit", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"kvgate import-ratelimit: {path}: ")
    assert problem in err


def test_a_missing_file(tmp_path: Path, capsys):
    assert main(["import-ratelimit", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_one_line_and_exit_2(tmp_path: Path, capsys):
    path = tmp_path / "rl.yaml"
    path.write_bytes(b"domain: d\n\xff\xfe\n")
    assert main(["import-ratelimit", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"kvgate import-ratelimit: {path}: cannot read: not UTF-8 text (byte 10)\n"


def test_a_domain_in_two_files_names_both(tmp_path: Path, capsys):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for path in (first, second):
        path.write_text("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n"
                        "      unit: hour\n      requests_per_unit: 7\n")
    assert main(["import-ratelimit", str(first), str(second)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"kvgate import-ratelimit: {second}: domain 'd' is already in {first}\n"


def test_a_trailing_wildcard_is_imported(tmp_path: Path, capsys):
    path = tmp_path / "rl.yaml"
    rule = imported_rule(path, "domain: d\ndescriptors:\n  - key: path\n    value: /v1/embed*\n"
                         "    rate_limit: {unit: second, requests_per_unit: 1}\n", capsys)
    assert rule["value"] == "/v1/embed*"
    # there the prefix of '/v1/embed**' is '/v1/embed*', a literal '*' kvgate cannot say
    path.write_text("domain: d\ndescriptors:\n  - key: path\n    value: /v1/embed**\n"
                    "    rate_limit: {unit: second, requests_per_unit: 1}\n")
    assert main(["import-ratelimit", str(path)]) == 2
    assert "descriptors[0].value: '/v1/embed**'" in capsys.readouterr().err


def test_requests_per_unit_0_is_kept(tmp_path: Path, capsys):
    # envoyproxy/ratelimit's uint32 0 refuses every hit; `0 in (False, …)` used to drop it
    # and the import failed with "give unit and requests_per_unit"
    rule = imported_rule(tmp_path / "rl.yaml", "domain: d\ndescriptors:\n  - key: k\n"
                         "    rate_limit:\n      unit: SECOND\n      requests_per_unit: 0\n",
                         capsys)
    assert rule["rate_limit"] == {"unit": "second", "requests_per_unit": 0,
                                  "algorithm": "fixed_window"}


def test_keys_and_values_keep_their_text_as_go_reads_it(tmp_path: Path, capsys):
    # Go strings keep `true` and `010` as written; PyYAML made them "True" and "8", which
    # no descriptor Envoy sends would ever match
    path = tmp_path / "rl.yaml"
    path.write_text("domain: 5\ndescriptors:\n  - key: flag\n    value: true\n"
                    "    rate_limit: {unit: second, requests_per_unit: 1}\n"
                    "  - key: 7\n    value: 010\n"
                    "    rate_limit: {unit: second, requests_per_unit: 1}\n"
                    "  - key: e\n    value: ~\n    shadow_mode: yes\n"
                    "    rate_limit: {unit: second, requests_per_unit: 1}\n")
    assert main(["import-ratelimit", str(path)]) == 0
    [domain] = RateLimitSettings.model_validate(
        yaml.safe_load(capsys.readouterr().out)["ratelimit"]).domains
    assert domain.domain == "5"
    assert [(d.key, d.value, d.shadow_mode) for d in domain.descriptors] == [
        ("flag", "true", False), ("7", "010", False), ("e", None, True)]


def test_limit_names_keep_their_text_as_go_reads_it(tmp_path: Path, capsys):
    # `name: 2024` is a Go string there; here it was an int, and the import refused a valid
    # file with "rate_limit.name: Input should be a valid string"
    path = tmp_path / "rl.yaml"
    path.write_text("domain: d\ndescriptors:\n  - key: a\n"
                    "    rate_limit: {unit: second, requests_per_unit: 1, name: 2024}\n"
                    "  - key: b\n    rate_limit: {unit: second, requests_per_unit: 2,"
                    " name: 010, replaces: [{name: 2024}]}\n")
    assert main(["import-ratelimit", str(path)]) == 0
    [domain] = RateLimitSettings.model_validate(
        yaml.safe_load(capsys.readouterr().out)["ratelimit"]).domains
    a, b = (d.rate_limit for d in domain.descriptors)
    assert (a.name, b.name, [r.name for r in b.replaces]) == ("2024", "010", ["2024"])


@pytest.mark.parametrize(("text", "problem"), [
    ("    shadow_mode: 'yes'\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
     "descriptors[0].shadow_mode: expected true or false, got 'yes'"),
    ("    rate_limit: {unlimited: 'no', unit: second, requests_per_unit: 1}\n",
     "descriptors[0].rate_limit.unlimited: expected true or false, got 'no'"),
])
def test_a_string_where_a_boolean_goes_is_refused(tmp_path: Path, capsys, text, problem):
    # a Go bool cannot hold a string; here "no" was truthy (no algorithm written) and
    # pydantic then read it as false: a token bucket, not the fixed window imports get
    path = tmp_path / "rl.yaml"
    path.write_text("domain: d\ndescriptors:\n  - key: k\n" + text)
    assert main(["import-ratelimit", str(path)]) == 2
    assert capsys.readouterr().err == f"kvgate import-ratelimit: {path}: {problem}\n"


def refused(path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``text`` written to ``path`` and imported: the one line on stderr, exit status 2."""
    path.write_text(text)
    assert main(["import-ratelimit", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err.strip()


def test_a_file_nested_too_deeply_is_one_line(tmp_path: Path, capsys):
    path = tmp_path / "rl.yaml"
    line = refused(path, "domain: d\ndescriptors: " + "[" * 500 + "]" * 500 + "\n", capsys)
    assert line == (f"kvgate import-ratelimit: {path}: line 2, column 113: nested too deeply "
                    "(more than 100 levels)")


def test_an_alias_bomb_is_refused(tmp_path: Path, capsys):
    lines = ["domain: d", "descriptors:",
             "  - &l0 {key: k0, rate_limit: {unit: second, requests_per_unit: 1}}"]
    lines += [f"  - &l{n} {{key: k{n}, descriptors: [{', '.join([f'*l{n - 1}'] * 10)}]}}"
              for n in range(1, 7)]
    line = refused(tmp_path / "rl.yaml", "\n".join(lines) + "\n", capsys)
    assert "expands to more than 1,000,000 values once aliases are expanded" in line


def test_a_duplicate_key_is_refused_with_its_line(tmp_path: Path, capsys):
    # envoyproxy/ratelimit's yaml.v2 Unmarshal keeps the last one without a word
    path = tmp_path / "rl.yaml"
    line = refused(path, "domain: d\ndescriptors:\n  - key: a\n    key: b\n"
                   "    rate_limit: {unit: second, requests_per_unit: 1}\n", capsys)
    assert line == (f"kvgate import-ratelimit: {path}: descriptors[0].key: duplicate key at line "
                    "4, column 5 (first at line 3, column 5; YAML would keep only the last)")
