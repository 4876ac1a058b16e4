"""Chat messages -> prompt text, with the model's chat template or a documented default.

Templates are rendered in Jinja's immutable sandbox, so a template shipped with a model cannot
reach Python objects or change state. Base models without a template (the default Gemma 3 270M
is one) get their family's turn format, listed in docs/server.md.
"""

from __future__ import annotations

from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.tokenizer import Tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")

DEFAULT_TEMPLATES = {
    # Gemma: system text joins the first user turn; the assistant is "model".
    "gemma3": (
        "{{ bos_token }}"
        "{%- set first_user = namespace(done=false, system='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role in ['system', 'developer'] -%}{%- set first_user.system = first_user.system + m.content + '\n\n' -%}"
        "{%- else -%}"
        "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
        "{%- if m.role == 'user' and not first_user.done %}{{ first_user.system }}{% set first_user.done = true %}{% endif -%}"
        "{{ m.content }}<end_of_turn>\n"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif -%}"
    ),
    # ChatML, as Qwen2/Qwen3 use it.
    "chatml": (
        "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
    ),
    # Llama 3 headers.
    "llama3": (
        "{{ bos_token }}{%- for m in messages -%}"
        "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
        "{%- endfor -%}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif -%}"
    ),
    # Anything else: plain role-prefixed lines.
    "plain": (
        "{%- for m in messages -%}{{ m.role }}: {{ m.content }}\n{%- endfor -%}"
        "{%- if add_generation_prompt %}assistant:{% endif -%}"
    ),
}


def default_template_name(family: str, tokenizer: Tokenizer) -> str:
    if family == "gemma3":
        return "gemma3"
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return "chatml"
    if tokenizer.token_to_id("<|start_header_id|>") is not None:
        return "llama3"
    return "plain"


@lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str):
        raise TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class ChatFormatter:
    def __init__(self, tokenizer: Tokenizer, family: str) -> None:
        self.tokenizer = tokenizer
        self.source = tokenizer.chat_template or DEFAULT_TEMPLATES[default_template_name(family, tokenizer)]
        self.uses_model_template = tokenizer.chat_template is not None

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """``messages``: validated [{'role', 'content': str}] -> prompt text; ``tools``: the
        request's tools, for a template that presents them to the model (others ignore them)."""
        bos = self.tokenizer.bos_token_id
        try:
            return _compile(self.source).render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.tokenizer.backend.id_to_token(bos) if bos is not None else "",
                eos_token="",
            )
        except TemplateError as exc:
            raise ValueError(f"messages: the chat template rejected them ({exc})") from exc
