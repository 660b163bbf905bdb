"""Error responses: every failure is OpenAI's envelope `{"error": {message, type, param, code}}`.

Invalid input is a 400 (SGLang and OpenAI answer 400, not FastAPI's default 422), a body over the
limit 413, a feature the engine lacks 501. The message names the field, the value and the limit.
`code` is the status, except where OpenAI names the error: a `model` the server does not serve is a 404
with type "invalid_request_error" and code "model_not_found", as OpenAI answers it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from r3trace.engine.request import InvalidRequestError


class ErrorDetail(BaseModel):
    message: str = Field(description="names the field, the value and the limit")
    type: str
    param: str | None = Field(default=None, description="the offending field, dotted (sampling_params.top_p)")
    code: int | str = Field(description="the HTTP status, or OpenAI's code where it names one (model_not_found)")


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: OpenAI's error envelope (SGLang's /generate errors also sit under `error`)."""

    error: ErrorDetail


_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 409: "ConflictError",
          413: "RequestTooLarge", 500: "InternalServerError", 501: "NotImplementedError",
          503: "ServiceUnavailable"}


# pydantic names the member of a union in `loc` ("text", "str"); these tags are not fields.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict"})


class ApiError(Exception):
    """Raised by handlers; becomes a JSON error with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code  # OpenAI's error code where it has one ("model_not_found"); else the status
        self.type = type_  # OpenAI's error type where it has one; else by status (_TYPES)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    detail = {"message": message, "type": type_ or _TYPES.get(status, "Error"), "param": param,
              "code": status if code is None else code}
    return ErrorResponse.model_validate({"error": detail}).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type_), status_code=status)


def _loc_name(loc: tuple[Any, ...]) -> str:
    """("body", "sampling_params", 0, "top_p") -> "sampling_params[0].top_p"; drops pydantic's union tags."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part not in _UNION_TAGS and "[" not in part and not part[:1].isupper():
            out += f".{part}" if out else part
    return out or "body"


def validation_message(exc: RequestValidationError) -> tuple[str, str]:
    """(field, message) for the first error, the one a person fixes first."""
    errors = list(exc.errors())
    first = errors[0]
    if first.get("type") == "model_attributes_type" and tuple(first.get("loc", ())) == ("body",):
        return "body", "body: not a JSON object (send JSON with Content-Type: application/json)"
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return "body", f"body: invalid JSON ({ctx.get('error', first.get('msg'))})"
    field = _loc_name(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        shown = repr(first.get("input"))[:80]
        return field, f"{field}: unknown field (value {shown}); see /openapi.json for the known ones"
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return field, f"{field}: {first.get('msg')} (got {shown})"


def install_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        field, message = validation_message(exc)
        return error_response(400, message, field)

    async def on_invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, InvalidRequestError)
        return error_response(400, str(exc), exc.field)

    async def on_api(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.type)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(exc.status_code, str(exc.detail))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(InvalidRequestError, on_invalid)
    app.add_exception_handler(ApiError, on_api)
    app.add_exception_handler(StarletteHTTPException, on_http)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "invalid input; the message names field, value and limit"},
    "5XX": {"model": ErrorResponse, "description": "the engine failed or lacks the feature (501)"},
}
