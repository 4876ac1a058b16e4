"""What the router weighs for one generation request, read from its body at the ingress: the
prompt's tokens (the chat template rendered as the replica will render it), so its full blocks
can be named as the replica's prefix cache names them, and its cost in tokens.

Nothing here refuses a request: a body this cannot read is routed without prefix information and
the replica's own validation answers it, with the single-process server's error."""

from __future__ import annotations

import json
import uuid
from typing import Any

from tandem.core.prefix_cache import PrefixHasher
from tandem.core.routing import RouteRequest, block_name
from tandem.server.chat import ROLES, ChatFormatter
from tandem.server.protocol import ChatCompletionRequest, validate

GENERATE_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
"""Generation routes, and whether each is chat."""
COMPLETION_MAX_TOKENS = 16
"""OpenAI's default max_tokens for completions."""
CHAT_MAX_TOKENS_ESTIMATE = 256
"""A chat request without max_tokens may generate up to the context's end; the router counts this many."""
MAX_CHOICES = 128


def route_request(path: str, body: bytes, tokenizer, chat: ChatFormatter, hasher: PrefixHasher | None
                  ) -> RouteRequest:
    route_id = uuid.uuid4().hex
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return RouteRequest(route_id, 0, 0)
    if not isinstance(data, dict):
        return RouteRequest(route_id, 0, 0)
    is_chat = GENERATE_PATHS.get(path, False)
    copies = _int(data.get("n"), 1, 1, MAX_CHOICES)
    limit = data.get("max_completion_tokens") if is_chat else None
    default = CHAT_MAX_TOKENS_ESTIMATE if is_chat else COMPLETION_MAX_TOKENS
    max_tokens = _int(limit if limit is not None else data.get("max_tokens"), default, 0, 1 << 24)
    try:
        ids, prompts = _prompt_ids(data, is_chat, tokenizer, chat)
    except Exception:  # the replica says what is wrong with it
        return RouteRequest(route_id, 0, max_tokens * copies)
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    names: tuple[int, ...] = ()
    if hasher is not None and ids:
        hashes: list[bytes] = []
        hasher.extend(hashes, salt, lambda a, b: ids[a:b], len(ids))
        names = tuple(block_name(h) for h in hashes)
    copies *= prompts
    return RouteRequest(route_id, len(ids) * copies, max_tokens * copies, names)


def _prompt_ids(data: dict[str, Any], is_chat: bool, tokenizer, chat: ChatFormatter) -> tuple[list[int], int]:
    """The first prompt's token ids, and how many prompts the request holds."""
    if is_chat:
        req = validate(ChatCompletionRequest, data)
        return tokenizer.encode(chat.render(req.plain_messages(ROLES), req.tools_for_template())), 1
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), 1
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt), 1
        first = prompt[0]
        if isinstance(first, str):
            return tokenizer.encode(first), len(prompt)
        if isinstance(first, list):
            return [t for t in first if isinstance(t, int)], len(prompt)
    return [], 1


def _int(value: Any, default: int, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        return default
    return min(max(value, low), high)
