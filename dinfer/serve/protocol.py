"""The OpenAI-compatible request and response bodies, as pydantic models (FastAPI validates requests
with them and publishes them in /openapi.json).

Requests are strict: a field of the wrong JSON type (a string where a number goes, a bool for an
integer) or a field the server does not know is refused, naming the field, rather than coerced or
ignored. OpenAI fields a diffusion model has no use for are accepted only at their neutral value
(n = 1, top_p = 1, penalties 0, no logprobs, ...), so a client that asks for more is told. The dLLM
extras (block_length, threshold, decoder, cache, and the joint decoder's edit_threshold and
max_post_edit_steps) are typed here and checked by the config classes
(dinfer.params), as the CLI's options are.
"""

from typing import Annotated, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, field_validator, model_serializer

from ..decoders import DECODERS
from ..generate import CACHE_MODES
from ..models.tokenizer import ROLES


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Body):
    include_usage: bool = Field(
        True, description="send a last chunk with `usage` (and no choices) before [DONE] (default: true)"
    )


def _is_ids(v) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def _one_of(check, expected: str, input_type):
    """A union checked by `check` (one message for the field, where pydantic would give one per
    member of the union), published in the schema as `input_type`."""

    def validate(v):
        if not check(v):
            raise ValueError(f"expected {expected}, got {_json_type(v)}")
        return v

    return PlainValidator(validate, json_schema_input_type=input_type)


_JSON_NAMES = {
    str: ("a string", "strings"),
    bool: ("a boolean", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    type(None): ("null", "nulls"),
    list: ("a list", "lists"),
}


def _json_type(v) -> str:
    """What a JSON value is, for a message: "an integer", "a list of strings", "a mixed list"."""
    if isinstance(v, list) and v:
        kinds = {_JSON_NAMES.get(type(x), ("an object", "objects"))[1] for x in v}
        return f"a list of {kinds.pop()}" if len(kinds) == 1 else "a mixed list"
    return "an empty list" if isinstance(v, list) else _JSON_NAMES.get(type(v), ("an object",))[0]


Stop = Annotated[
    Union[str, List[str], None],
    _one_of(
        lambda v: (
            v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        ),
        "a string or a list of strings",
        Union[str, List[str], None],
    ),
]


def _neutral(value, neutral):
    if value is not None and value != neutral:
        raise ValueError(f"only {neutral!r} is supported: a diffusion model decodes without it")
    return value


class GenerationRequest(Body):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="most tokens generated (default: the checkpoint's gen_length); decoded as whole "
        "blocks, the answer cut back to max_tokens",
    )
    temperature: Optional[float] = Field(None, description="0: the most likely token (default: the server's)")
    seed: Optional[int] = Field(None, description="sampling seed, in [0, 2**32)")
    stop: Stop = Field(None, description="the answer ends before the first of these")
    n: int = Field(1, description="only 1")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    top_p: Optional[float] = Field(None, description="only 1")
    presence_penalty: Optional[float] = Field(None, description="only 0")
    frequency_penalty: Optional[float] = Field(None, description="only 0")
    logit_bias: Optional[Dict[str, float]] = Field(None, description="only empty")
    user: Optional[str] = None
    # dLLM extras: GenerationConfig / DecoderConfig fields, checked by those classes
    block_length: Optional[int] = Field(None, description="tokens per block (default: the checkpoint's)")
    threshold: Optional[float] = Field(None, description="commit threshold in [0, 1]")
    decoder: Optional[str] = Field(None, description=f"decoding strategy: {', '.join(DECODERS)}")
    cache: Optional[str] = Field(None, description=f"KV cache mode: {', '.join(CACHE_MODES)}")
    edit_threshold: Optional[float] = Field(
        None, description="decoder 'joint': rewrite generated tokens above this confidence (<= 0: off)"
    )
    max_post_edit_steps: Optional[int] = Field(
        None, description="decoder 'joint': forwards that only edit after a block's last [MASK]"
    )

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError("only n = 1 is supported: send one request per answer")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        return _neutral(v, 1.0)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v):
        return _neutral(v, 0.0)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v:
            raise ValueError("not supported: a diffusion model decodes without it")
        return v


Prompt = Annotated[
    Union[str, List[int], List[str], List[List[int]]],
    _one_of(
        lambda v: (
            isinstance(v, str)
            or _is_ids(v)
            or (isinstance(v, list) and all(isinstance(x, str) or _is_ids(x) for x in v))
        ),
        "a string, a list of token ids, or a list of those",
        Union[str, List[int], List[str], List[List[int]]],
    ),
]


class CompletionRequest(GenerationRequest):
    prompt: Prompt = Field(description="the text as is (no chat template), or its token ids; one prompt")
    echo: bool = Field(False, description="only false")
    suffix: Optional[str] = Field(None, description="only null")
    best_of: Optional[int] = Field(None, description="only 1")
    logprobs: Optional[int] = Field(None, description="only null")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        return _neutral(v, False)

    @field_validator("suffix", "logprobs")
    @classmethod
    def _none(cls, v):
        if v is not None:
            raise ValueError("not supported: send null or leave it out")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        return _neutral(v, 1)


class TextPart(Body):
    type: Literal["text"]
    text: str


def _content(v):
    """A message's content: a string, or text parts [{"type": "text", "text": ...}] joined."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "".join(TextPart.model_validate(p).text for p in v)
    raise ValueError(f"expected a string or a list of text parts, got {_json_type(v)}")


class ChatMessage(Body):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Annotated[str, PlainValidator(_content, json_schema_input_type=Union[str, List[TextPart]])]
    name: Optional[str] = None

    def as_dict(self) -> dict:
        return {"role": self.role, "content": self.content, **({"name": self.name} if self.name else {})}


class ChatCompletionRequest(GenerationRequest):
    messages: List[ChatMessage] = Field(description="the conversation, in the checkpoint's chat template")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="max_tokens' newer name")
    logprobs: Optional[bool] = Field(None, description="only false")
    top_logprobs: Optional[int] = Field(None, description="only null")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        return _neutral(v, False)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        if v is not None:
            raise ValueError("not supported: send null or leave it out")
        return v


# ------------------------------------------------------------------------------------------ responses

FinishReason = Optional[Literal["stop", "length"]]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    forwards: int = Field(description="the model forwards the request ran (a batched forward counts once)")
    tokens_per_forward: float = Field(description="completion_tokens / forwards")


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):  # OpenAI's deltas hold what is new: {} at the end
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dinfer"
    max_model_len: int = Field(description="positions of the longest sequence (prompt + answer) served")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
