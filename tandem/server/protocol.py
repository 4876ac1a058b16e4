"""OpenAI request bodies (validated strictly: a wrong type is a 400 naming the field) and the
error shape ``{"error": {"message", "type", "param", "code"}}``.

Strict but for one thing: an integer field takes an integral float (``4.0``), as vLLM does;
``4.5`` is refused. ``seed`` takes the signed 64-bit range, as vLLM does. A field no model declares
is refused (400 naming it), as OpenAI refuses unknown parameters; fields known elsewhere but not
served here are refused with the reason (``unsupported.py``).

Longer than 300 lines: the request bodies and the error shape they raise are read together; the
errors would move to their own module if another one needed them without the bodies."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any, Iterator, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from tandem.core.constraint import Constraint
from tandem.core.sampling_params import SamplingParams
from tandem.server.structured import StructuredFields
from tandem.server.tool_calls import ToolFields, ToolFormat
from tandem.server.unsupported import RefusedFields, unsupported_field

SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
"""The seeds a request may give; a choice ``j`` of ``n`` is seeded ``seed + j``, which the
sampler's 64 bits still hold."""

USER_HEADER = "X-Tandem-User"
"""Names the request's user (fair sharing's tenant) instead of the body's ``user``; it wins over
the body, since a gateway in front of the server sets it from the credentials it checked."""
MAX_USER_CHARS = 256
MAX_CACHE_SALT_CHARS = 256


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def from_value_error(exc: ValueError) -> APIError:
    """Engine errors are 'field: message'; the field becomes the error's param."""
    text = str(exc)
    head, sep, _ = text.partition(":")
    param = head.strip() if sep and head.strip().translate(_FIELD_PUNCTUATION).isalnum() else None
    return bad_request(text, param)


_FIELD_PUNCTUATION = str.maketrans("", "", "_[].")


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
"""An integer, or a float with an integer value."""


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """``exc`` with its param (and the message's leading field name) renamed by ``names``."""
    if exc.param is None:
        return exc
    head, dot, rest = exc.param.partition(".")
    base, bracket, index = head.partition("[")
    if base not in names:
        return exc
    param = names[base] + bracket + index + dot + rest
    message = exc.message
    if message.startswith(exc.param + ":"):
        message = param + message[len(exc.param):]
    return APIError(exc.status, message, param=param, type_=exc.type, code=exc.code, headers=exc.headers)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Common(StructuredFields, RefusedFields):  # type: ignore[misc, valid-type]
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(default=None, description=(
        "token id (a decimal string) -> bias in [-100, 100] added to its logit; at most 300 entries"))
    metadata: dict[str, str] | None = Field(default=None, description="accepted with no effect: nothing is stored")
    # extensions
    top_k: Int | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    min_p: float | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    priority: Int = 0
    stop_token_ids: list[Int] | None = None
    target_itl_ms: float | None = Field(default=None, description=(
        "inter-token latency target (ms) for this request's stream; tightens the server's --target-itl-ms, "
        "never below its --min-target-itl-ms"))
    target_ttft_ms: float | None = Field(default=None, description=(
        "time-to-first-token target (ms), replacing the server's --target-ttft-ms; never below its "
        "--min-target-ttft-ms"))
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=(
        "prefix-cache salt: the request shares cached prompt blocks only with requests that give the same "
        "salt, so one tenant cannot learn another's prompts from how fast its own are answered"))

    def tenant(self, header: str | None) -> str:
        """The user this request is served for: the ``X-Tandem-User`` header, else the body's
        ``user``, else "" (anonymous). Both are checked when given."""
        if self.user is not None:
            check_user(self.user, "user")
        if header is not None:
            return check_user(header, f"user: the {USER_HEADER} header")
        return self.user or ""

    def _sampling(self, max_tokens: int | None, logprobs: int | None, default_max: int | None,
                  tools: ToolFormat | None = None) -> SamplingParams:
        """Fields the client left out keep SamplingParams' defaults (OpenAI's); ``default_max``
        replaces the default ``max_tokens`` where the route's default differs (chat); ``tools``:
        the forced tool call whose arguments constrain the output."""
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise bad_request(f"seed: must be an integer in [-2**63, 2**63 - 1], got {self.seed}", "seed")
        refused = unsupported_field(self)
        if refused is not None:
            raise bad_request(refused[1], refused[0])
        if not 1 <= self.n <= 16:
            raise bad_request(f"n: must be between 1 and 16, got {self.n}", "n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 16:
            raise bad_request("stop: at most 16 stop strings", "stop")
        if max_tokens is not None and 0 < max_tokens < self.min_tokens:
            raise bad_request(f"min_tokens: must not exceed max_tokens ({max_tokens}), got {self.min_tokens}",
                              "min_tokens")
        given = {
            "max_tokens": default_max if max_tokens is None else max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
        }
        try:
            constraint = self._constraint(tools)
            return SamplingParams(
                **{k: v for k, v in given.items() if v is not None},
                seed=self.seed,
                stop=stop,
                stop_token_ids=self.stop_token_ids or (),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                target_itl_ms=self.target_itl_ms,
                target_ttft_ms=self.target_ttft_ms,
                logit_bias=_token_keys(self.logit_bias),
                min_tokens=self.min_tokens,
                bad_words=self.bad_words or (),
                include_stop_str_in_output=self.include_stop_str_in_output,
                constraint=constraint,
            )
        except ValueError as exc:
            raise from_value_error(exc) from None


    def _constraint(self, tools: ToolFormat | None) -> Constraint | None:
        constraint = self.output_constraint()
        if tools is None:
            return constraint
        if constraint is not None:
            raise ValueError(f"{constraint.field}: cannot be combined with a forced tool call (tool_choice)")
        return tools.constraint()


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON's string keys as token ids ("42" -> 42)."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise bad_request(f"logit_bias: keys must be token ids (decimal integers), got {key[:32]!r}", "logit_bias")
        out[int(key)] = value
    return out


def check_user(value: str, what: str) -> str:
    if not 1 <= len(value) <= MAX_USER_CHARS or not value.isprintable():
        raise bad_request(f"{what} must be 1 to {MAX_USER_CHARS} printable characters, got {value[:64]!r}", "user")
    return value


class CompletionRequest(_Common):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.echo:
            raise bad_request("echo: not supported by this server", "echo")
        if self.suffix:
            raise bad_request("suffix: not supported by this server", "suffix")
        return self._sampling(self.max_tokens, self.logprobs, None)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt: must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common, ToolFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None

    def sampling_params(self, default_max: int, tools: ToolFormat | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        lp = (self.top_logprobs or 0) if self.logprobs else None
        with self.field_names():
            return self._sampling(max_tokens, lp, default_max, tools)

    @contextlib.contextmanager
    def field_names(self) -> Iterator[None]:
        """Errors raised inside name this request's fields: the engine's ``prompt`` is the
        ``messages``, its ``max_tokens`` what the client set and its ``logprobs`` ``top_logprobs``."""
        names = {"prompt": "messages", "logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        try:
            yield
        except APIError as exc:
            raise renamed(exc, names) from None

    def plain_messages(self, roles: tuple[str, ...]) -> list[dict[str, str]]:
        if not self.messages:
            raise bad_request("messages: must not be empty", "messages")
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in roles:
                raise bad_request(f"messages[{i}].role: unknown role {m.role!r}; expected one of {', '.join(roles)}",
                                  f"messages[{i}].role")
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            out.append({"role": m.role, "content": content})
        return out


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # false: no BOS is prepended


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[Int] = Field(default_factory=list)


def validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # an unknown field is named even where a union's other branch failed first
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        # keep field names and list indexes; drop pydantic's union-branch tags such as 'str'
        parts: list[str] = []
        for x in err["loc"]:
            if isinstance(x, int):
                parts.append(f"[{x}]")
            elif x in _UNION_TAGS or "[" in str(x):
                continue
            else:
                parts.append(("." if parts else "") + str(x))
        param = "".join(parts) or None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"{param}: unknown parameter; this server does not support it", param) from None
        raise bad_request(f"{param}: {err['msg']}" if param else err["msg"], param) from None


_UNION_TAGS = {"str", "int", "float", "bool", "TextPart", "StreamOptions", "NamedToolChoice",
               "dict[str,any]", "list[str]"}
