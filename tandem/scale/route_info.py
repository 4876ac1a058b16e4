"""What the router weighs for one generation request, read from its body at the ingress: the
prompt's tokens (the chat template rendered as the replica will render it), so its full blocks
can be named as the replica's prefix cache names them, and its cost in tokens.

The body is read with the server's own request models. Nothing here refuses a request: a body
they refuse is routed without prefix information and the replica's own validation answers it,
with the single-process server's error."""

from __future__ import annotations

import uuid

from tandem.core.prefix_cache import PrefixHasher
from tandem.core.routing import RouteRequest, prompt_block_names
from tandem.server.chat import ROLES, ChatFormatter
from tandem.server.json_body import parse
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, validate

GENERATE_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}
"""Generation routes, and whether each is chat."""
COMPLETION_MAX_TOKENS = 16
"""OpenAI's default max_tokens for completions."""
CHAT_MAX_TOKENS_ESTIMATE = 256
"""A chat request without max_tokens may generate up to the context's end; the router counts this many."""


def route_request(path: str, body: bytes, tokenizer, chat: ChatFormatter, hasher: PrefixHasher | None
                  ) -> RouteRequest:
    route_id = uuid.uuid4().hex
    is_chat = GENERATE_PATHS.get(path, False)
    try:
        data = parse(body)
        if is_chat:
            req = validate(ChatCompletionRequest, data)
            limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            prompts = [tokenizer.encode(chat.render(req.plain_messages(ROLES), req.tools_for_template()))]
        else:
            req = validate(CompletionRequest, data)
            limit = req.max_tokens
            prompts = req.prompts()
        first = prompts[0]
        ids = list(first) if isinstance(first, list) else tokenizer.encode(first)
    except Exception:  # the replica says what is wrong with it
        return RouteRequest(route_id, 0, 0)
    max_tokens = limit if limit is not None else CHAT_MAX_TOKENS_ESTIMATE if is_chat else COMPLETION_MAX_TOKENS
    names = prompt_block_names(hasher, req.cache_salt, lambda a, b: ids[a:b], len(ids)) if hasher else ()
    copies = req.n * len(prompts)
    return RouteRequest(route_id, len(ids) * copies, max_tokens * copies, names)
