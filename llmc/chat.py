"""Chat templates: a conversation's messages rendered into the prompt text a chat model was trained on.

The template is Jinja source that comes with a model (its tokenizer's `chat_template`, kept in the
artifact's `ModelInfo`) or from the user. It runs in a sandbox, as transformers runs it: a template sees
the messages it is given and nothing of Python beyond them. `LLM.chat` and the server's
/v1/chat/completions render through here.

Example:
    >>> t = compile_template("{% for m in messages %}{{ m.role }}: {{ m.content }}\\n{% endfor %}")
    >>> render(t, [{"role": "user", "content": "hi"}])
    'user: hi\\n'
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from llmc.errors import LLMCError, RequestError


def compile_template(source: str, other: str = "with --chat-template FILE"):
    """A sandboxed Jinja template of `source`; LLMCError (one line) where it does not parse, saying how to give
    `other` template."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise LLMCError(f"the chat template does not parse (line {e.lineno}: {e.message}); fix it or give another "
                        f"{other}") from None


def render(template, messages: list[dict], tokenizer=None, add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` ({"role", "content"[, "name"]} each); the tokenizer's bos and eos tokens are
    the template's `bos_token` and `eos_token`. Raises jinja2's TemplateError where the template refuses them."""
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=getattr(tokenizer, "bos_token", "") or "",
                           eos_token=getattr(tokenizer, "eos_token", "") or "")


def check_messages(messages, where: str = "messages") -> list[dict]:
    """The messages of one conversation as the template sees them, or RequestError naming the first bad one:
    a non-empty list of mappings, each with a string role and string content (and optionally a string name)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise RequestError(f"{where} must be a non-empty list of messages like {{'role': 'user', 'content': "
                           "'...'}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise RequestError(f"{where}[{i}] must be a mapping with a string 'role' and a string 'content', "
                               f"got {m!r:.80}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise RequestError(f"{where}[{i}]['name'] must be a string")
        out.append({"role": m["role"], "content": m["content"], **({"name": m["name"]} if m.get("name") else {})})
    return out


def conversation_texts(engine, messages, chat_template: str | None = None,
                       add_generation_prompt: bool = True) -> list[str]:
    """The prompt text of one conversation (a list of message dicts) or of each of several (a list of them),
    rendered by `chat_template` or the engine's artifact's template; RequestError (nothing queued) where
    there is no template or tokenizer, a message is malformed, or the template refuses them."""
    import jinja2
    source = chat_template if chat_template is not None else engine.info.chat_template
    if not source:
        raise RequestError("this model has no chat template, so it cannot format messages: pass chat_template= "
                           "(Jinja over `messages`), or generate from your own prompt text")
    if engine.tokenizer is None:
        raise RequestError("this artifact has no tokenizer, so it cannot encode a conversation's text")
    template = compile_template(source, "as chat_template=")
    one = isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)
    conversations = [messages] if one else list(messages)
    if not conversations:
        raise RequestError("no conversations given")
    texts = []
    for i, conv in enumerate(conversations):
        where = "messages" if one else f"messages[{i}]"
        try:
            texts.append(render(template, check_messages(conv, where), engine.tokenizer, add_generation_prompt))
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"the chat template refused {where}: {e}") from None
    return texts
