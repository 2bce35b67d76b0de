"""Prompts: a chat rendered with the model's template (or plain ``User:/Assistant:`` text), as token ids."""

from __future__ import annotations

from typing import Any

from engine.generation.params import GenerationError

ROLES: tuple[str, ...] = ("system", "user", "assistant")


def render_prompt(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
) -> list[int]:
    """The token ids of a prompt or a conversation, ready for :func:`generate`.

    Exactly one of ``prompt`` / ``messages`` (``[{"role": "system"|"user"|"assistant",
    "content": str}]``). ``chat_template=None`` uses the tokenizer's chat template when it has
    one; True requires one (``NO_CHAT_TEMPLATE`` otherwise); False never uses it.

    * With the template: ``apply_chat_template`` with a generation prompt; a plain ``prompt``
      becomes one user message, ``system_prompt`` a leading system message.
    * Messages without a template, a plain fallback::

          <system>\\n\\n          (system_prompt, then system messages; only when there is one)
          User: <content>\\n
          Assistant: <content>\\n
          Assistant:

      tokenized with the tokenizer's special tokens (a BOS where it adds one).
    * A plain prompt without a template: the text itself (``system_prompt + "\\n\\n"`` first when
      given), tokenized with the special tokens.

    Raises :class:`GenerationError` ``INVALID_PARAMETER`` for a malformed request and
    ``EMPTY_PROMPT`` when the result has no tokens.
    """
    if (prompt is None) == (messages is None):
        raise GenerationError(
            "INVALID_PARAMETER", "Give exactly one of prompt and messages.", {"field": "prompt"}
        )
    if prompt is not None and not isinstance(prompt, str):
        raise GenerationError("INVALID_PARAMETER", "prompt must be a string.", {"field": "prompt"})
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise GenerationError(
            "INVALID_PARAMETER", "system_prompt must be a string.", {"field": "system_prompt"}
        )
    conversation = _checked_messages(messages) if messages is not None else None
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise GenerationError("NO_CHAT_TEMPLATE", "This model's tokenizer has no chat template.")
    use_template = has_template if chat_template is None else bool(chat_template)

    if use_template:
        if conversation is None:
            conversation = [{"role": "user", "content": prompt}]
        if system_prompt:
            conversation = [{"role": "system", "content": system_prompt}, *conversation]
        rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        token_ids = _template_ids(rendered)
    elif conversation is not None:
        token_ids = _token_ids(tokenizer, _plain_conversation(conversation, system_prompt))
    else:
        text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        token_ids = _token_ids(tokenizer, text or "")
    if not token_ids:
        raise GenerationError("EMPTY_PROMPT", "The prompt has no tokens.")
    return token_ids


def _checked_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise GenerationError(
            "INVALID_PARAMETER", "messages must be a non-empty list.", {"field": "messages"}
        )
    for message in messages:
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise GenerationError(
                "INVALID_PARAMETER",
                f"Each message needs a role ({', '.join(ROLES)}) and a string content.",
                {"field": "messages"},
            )
    return [{"role": message["role"], "content": message["content"]} for message in messages]


def _plain_conversation(messages: list[dict], system_prompt: str | None) -> str:
    system = [system_prompt] if system_prompt else []
    system += [message["content"] for message in messages if message["role"] == "system"]
    lines = [
        f"{message['role'].capitalize()}: {message['content']}\n"
        for message in messages
        if message["role"] != "system"
    ]
    header = "\n\n".join(system) + "\n\n" if system else ""
    return header + "".join(lines) + "Assistant:"


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return [int(token) for token in tokenizer(text, add_special_tokens=True)["input_ids"]]


def _template_ids(rendered: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (a dict) where 4.x returned the list itself.
    if hasattr(rendered, "keys") and "input_ids" in rendered:
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    rendered = list(rendered)
    if rendered and isinstance(rendered[0], (list, tuple)):
        rendered = list(rendered[0])
    return [int(token) for token in rendered]
