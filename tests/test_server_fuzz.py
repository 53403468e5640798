"""Schema-driven fuzzing of the chat API with schemathesis: whatever the generated request, fitting
the schema or not, the server answers without a 5xx."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed: pip install schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from test_chat import make_backend  # noqa: E402

from lockstep.infer.server import ServerConfig, create_app  # noqa: E402


def fuzz_schema():
    backend, _, _ = make_backend("fuzzed ☃ reply")
    app = create_app(backend, ServerConfig(max_body_bytes=8192, max_messages=6, max_message_tokens=200,
                                           max_conversation_tokens=400, max_reply_tokens=32, default_max_tokens=8))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


# Built once for the strategies below; an app does no work until a request arrives.
SCHEMA = fuzz_schema()
# No shrink phase: a failing case is reported as generated, and the run stays bounded in time.
FUZZ = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


@FUZZ
@given(case=SCHEMA.as_strategy(GenerationMode.POSITIVE))
def test_requests_that_fit_the_schema_never_get_a_5xx(case):
    response = case.call_and_validate(checks=[not_a_server_error])
    if case.operation.path == "/v1/chat/completions":
        # Fits the schema, yet the token limits, role order (validators) or body cap may refuse it.
        assert response.status_code in (200, 413, 422), response.text


@FUZZ
@given(case=SCHEMA.as_strategy(GenerationMode.NEGATIVE))
def test_requests_that_break_the_schema_never_get_a_5xx(case):
    response = case.call_and_validate(checks=[not_a_server_error])
    if case.operation.path == "/v1/chat/completions" and case.method == "POST":
        assert 400 <= response.status_code < 500, response.text
