"""The OpenAPI schema describes every JSON response: no route answers JSON of an unknown shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.settings import get_settings


@pytest.fixture(scope="module")
def openapi(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("openapi")
    app = create_app(get_settings(data_dir=root / "data", database_url=f"sqlite:///{root / 'o.db'}"))
    with TestClient(app) as client:
        r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def _resolve(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref:
        return components[ref.rsplit("/", 1)[-1]]  # type: ignore[no-any-return]
    return schema


def _describes_something(schema: dict[str, Any], components: dict[str, Any]) -> bool:
    """False for what FastAPI emits for an untyped route: ``{}`` (``-> Any``) or a bare
    ``{"type": "object", "additionalProperties": true}`` (``-> dict[str, Any]``)."""
    resolved = _resolve(schema, components)
    if not resolved:
        return False
    for key in ("anyOf", "oneOf", "allOf"):
        if key in resolved:
            return all(_describes_something(s, components) for s in resolved[key])
    if resolved.get("type") == "array":
        return _describes_something(resolved.get("items", {}), components)
    if resolved.get("type") == "object" or "properties" in resolved:
        return bool(resolved.get("properties"))
    return "type" in resolved


def test_every_json_success_response_has_a_response_schema(openapi):
    components = openapi.get("components", {}).get("schemas", {})
    untyped = []
    for path, methods in openapi["paths"].items():
        for method, op in methods.items():
            for status, resp in op.get("responses", {}).items():
                if not status.startswith("2"):
                    continue
                content = resp.get("content", {})
                json_media = content.get("application/json")
                if json_media is not None and not _describes_something(json_media.get("schema", {}),
                                                                        components):
                    untyped.append(f"{method.upper()} {path} -> {status}")
    assert not untyped, "JSON routes without a response model: " + ", ".join(untyped)


def test_every_route_answers_something_the_schema_names(openapi):
    """A 2xx response either has typed content or none at all (204); the walk above saw them all."""
    seen = 0
    for methods in openapi["paths"].values():
        for op in methods.values():
            for status, resp in op.get("responses", {}).items():
                if status.startswith("2"):
                    seen += 1
                    assert resp.get("content") or status == "204", op.get("operationId")
    assert seen >= 20  # every router is registered


@pytest.mark.parametrize("path,method,model", [
    ("/v1/answer", "post", "Answer"),
    ("/v1/advise", "post", "Advice"),
    ("/v1/advise/curve", "get", "AdviceCurve"),
    ("/v1/chat/completions", "post", "ChatCompletion"),
    ("/v1/completions", "post", "TextCompletion"),
    ("/v1/latency/profiles/{profile_id}", "get", "ProfileDetail"),
])
def test_answer_routes_name_their_typed_models(openapi, path, method, model):
    schema = openapi["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
    assert schema.get("$ref", "").endswith("/" + model)


def test_every_schema_says_what_it_is(openapi):
    """Each request and response model carries its docstring into the schema as a description."""
    bare = [name for name, schema in openapi.get("components", {}).get("schemas", {}).items()
            if not schema.get("description")]
    assert not bare, "schemas without a description (give the model a docstring): " + ", ".join(bare)
