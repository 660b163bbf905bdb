"""Chat messages -> one prompt string, through the checkpoint's jinja chat template when it has one.

The template runs in jinja's immutable sandbox: it comes from a model folder, not from us.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ApiError
from .openai_requests import ChatMessage

FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def load_chat_template(model_dir: str | Path) -> str | None:
    """The `chat_template` of tokenizer_config.json (a string, or the "default" one of a list), else None."""
    path = Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return None
    tpl = json.loads(path.read_text()).get("chat_template")
    if isinstance(tpl, list):
        by_name = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = by_name.get("default")
    return tpl if isinstance(tpl, str) else None


def render_chat(messages: list[ChatMessage], template: str | None, kwargs: dict[str, Any] | None = None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The prompt: `template` over the messages; `kwargs` are extra template variables (chat_template_kwargs, as
    transformers' apply_chat_template passes them), never overriding messages or add_generation_prompt.

    continue_final_message with a last assistant message (SGLang's OpenAIServingChat._handle_last_assistant_message
    and _apply_jinja_template, serving_chat.py at sgl-project/sglang 002897c23becbd522d88b8115a763a21765f978a): the
    template renders the messages before it with the generation prompt, and that message's text follows unclosed,
    so the model continues it. With another last message the flag changes nothing, as in SGLang."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tpl = env.from_string(template or FALLBACK_TEMPLATE)
    msgs = [{**m.model_dump(exclude_none=True), "content": message_text(m, i)} for i, m in enumerate(messages)]
    prefix = ""
    if continue_final_message and msgs[-1]["role"] == "assistant":
        prefix, msgs, add_generation_prompt = msgs[-1]["content"], msgs[:-1], True
    return tpl.render({"bos_token": "", "eos_token": "", **(kwargs or {}), "messages": msgs,
                       "add_generation_prompt": add_generation_prompt}) + prefix


def message_text(message: ChatMessage, index: int) -> str:
    """A message's content as one string: OpenAI text parts joined with newlines; any other part is a 400."""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        field = f"messages[{index}].content[{j}]"
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{field}: a {part.get('type')!r} part: only text is served (a text-only model)",
                           field)
        texts.append(part["text"])
    return "\n".join(texts)
