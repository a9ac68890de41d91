"""Scenario 8, auth: `ballast serve --api-key` refuses every /v1 route (read from the server's own
OpenAPI schema, so a new route is covered) without the right key, with an OpenAI error body;
/health, /ready and /metrics stay open, /dashboard follows the key; neither the key nor a wrong
one appears in the logs, even at debug level."""

from __future__ import annotations

import httpx
import openai
import pytest
from harness import ballast_serve

pytestmark = pytest.mark.slow

KEY = "sk-ballast-7f3a9c1e5d"
WRONG = (
    "",
    "Bearer",
    "Bearer sk-ballast-7f3a9c1e5e",
    "Bearer sk-ballast",
    "Bearer " + KEY + "x",
    "Basic " + KEY,
    KEY,
    "bearer  sk-wrong-key-of-another-length-entirely",
)


def test_every_v1_route_needs_the_key_probes_stay_open_and_no_key_is_logged() -> None:
    with ballast_serve(
        ["--api-key", KEY, "--served-model-name", "tiny", "--log-level", "debug", "--log-format", "json"]
    ) as server:
        url = server.url
        paths = httpx.get(url + "/openapi.json").json()["paths"]
        routes = [(path, method) for path, ops in paths.items() if path.startswith("/v1") for method in ops]
        assert {("/v1/models", "get"), ("/v1/chat/completions", "post"), ("/v1/completions", "post")} <= set(
            routes
        )
        for path, method in routes:
            for header in WRONG:
                headers = {"Authorization": header} if header else {}
                r = httpx.request(
                    method.upper(), url + path, headers=headers, json={"model": "tiny", "prompt": "x"}
                )
                assert r.status_code == 401, (path, header, r.status_code)
                error = r.json()["error"]
                # Anthropic's routes answer in its shape (no code; the type names the error)
                assert (
                    error["type"] == "authentication_error"
                    if path.startswith("/v1/messages")
                    else error["code"] == "invalid_api_key"
                ) and r.headers["www-authenticate"] == "Bearer", (path, error)
        for open_path in ("/health", "/ready", "/metrics"):
            assert httpx.get(url + open_path).status_code == 200, open_path
        for page in ("/dashboard", "/dashboard/state"):  # the page names the model: it follows the key
            assert httpx.get(url + page).status_code == 401, page
            assert httpx.get(url + page, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert answer.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        log = "".join(server.log)
    assert "401" in log or "invalid_api_key" in log or "/v1/models" in log  # the log did record requests
    for secret in (KEY, "sk-ballast-7f3a9c1e5e", "sk-wrong"):
        assert secret not in log, f"{secret!r} appears in the server log"
