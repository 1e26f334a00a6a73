"""Envoy to kvgate over mutual TLS: the rendered ext_proc cluster's transport socket against
kvgate's TLS listener (``server.tls`` with a client CA), through real Envoy."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from extproc.config import hash_api_key, parse_config
from extproc.demo import local_stack
from tests.conftest import free_port
from tests.pki import make_pki

pytestmark = pytest.mark.e2e

KEY = "sk-tls"


def test_requests_pass_when_envoy_talks_mutual_tls_to_kvgate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    config = parse_config({
        "server": {"grpc_port": free_port(), "admin_port": 0,
                   "tls": {"cert_file": str(pki / "localhost.pem"),
                           "key_file": str(pki / "localhost.key"),
                           "client_ca_file": str(pki / "ca.pem")}},
        "envoy": {"listen_port": free_port(), "admin_port": free_port(),
                  "ext_proc_tls": {"ca_file": str(pki / "ca.pem"), "server_name": "localhost",
                                   "cert_file": str(pki / "envoy.pem"),
                                   "key_file": str(pki / "envoy.key")}},
        "tiers": {"t": {}},
        "tenants": [{"name": "acme", "tier": "t", "api_keys": [hash_api_key(KEY)]}],
        "pools": [{"name": "one", "models": [{"name": "tiny-llama"}],
                   "endpoints": [f"127.0.0.1:{free_port()}"]}],
    })
    with local_stack(config, engine_options={"ms_per_token": 1}) as stack:
        response = httpx.post(stack.url + "/v1/chat/completions", timeout=20,
                              headers={"authorization": f"Bearer {KEY}"},
                              json={"model": "tiny-llama", "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 200, response.text
        assert "x-bench-engine" in response.headers  # routed by kvgate: Envoy cannot alone
        anonymous = httpx.post(stack.url + "/v1/chat/completions", timeout=20,
                               json={"model": "tiny-llama", "messages": []})
        assert anonymous.status_code == 401  # kvgate's own answer, over the same TLS stream
