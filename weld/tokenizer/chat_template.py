"""Render chat templates the way HF transformers does, so a prompt is the same string in both.

Chat templates are Jinja programs shipped with a model, so they are untrusted: they run in an
immutable sandbox. The environment matches transformers' (`utils/chat_template_utils.py`):
`trim_blocks`, `lstrip_blocks`, the loop-controls extension, a `{% generation %}` block (HF uses it
to mark assistant text; here it just renders its body), `raise_exception`, `strftime_now`, and a
`tojson` that does not HTML-escape (Jinja's own would turn `<` into `\\u003c`).
"""

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from weld.utils.errors import InvalidInputError

# Appended to the final message for `continue_final_message`: the rendered prompt is cut where it
# lands, so whatever the template puts after the message (end-of-turn tokens) is dropped.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# Gemma 3's chat template (google/gemma-3-*'s tokenizer_config.json), for Gemma GGUFs converted
# without one (gemma-3-270m-q4_k_m.gguf is). Without it such a file cannot chat at all, and HF
# refuses too; llama.cpp's server would fall back to ChatML, which the model never saw. A system
# message becomes the head of the first user turn, as in llama.cpp's built-in "gemma" format.
GEMMA_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

# Built-in templates for vocabularies whose GGUF carries none: (turn markers the vocabulary must
# have as control tokens, template).
_BUILTIN = ((("<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE),)


def builtin_template(control_tokens: set[str]) -> str | None:
    """The template of the first known chat format whose turn markers are all control tokens of
    the vocabulary, or None."""
    for markers, template in _BUILTIN:
        if all(m in control_tokens for m in markers):
            return template
    return None


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once; a syntax error becomes `InvalidInputError`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidInputError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e


def render(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None,
    continue_final_message: bool,
    variables: dict,
) -> str:
    """Render `source` for `messages`; `variables` holds bos_token, eos_token and extra kwargs.

    With `continue_final_message` the prompt ends right after the last message's content, with no
    end-of-turn marker, so the model continues that message (HF semantics; it forces
    `add_generation_prompt` off, since a new assistant header would contradict it).
    """
    template = compile_template(source)
    messages = [dict(m) for m in messages]  # the tag below must not touch the caller's messages
    if continue_final_message:
        _tag_final_message(messages)
        add_generation_prompt = False
    context = {**variables, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
    try:
        text = template.render(**context)
    except jinja2.TemplateError as e:
        raise InvalidInputError(f"chat template failed: {e.message or e}") from e
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise InvalidInputError(f"chat template failed: {type(e).__name__}: {e}") from e
    if continue_final_message:
        text = _cut_at_tag(text)
    return text


def _tag_final_message(messages: list[dict]) -> None:
    if not messages:
        raise InvalidInputError("continue_final_message is set but there are no messages")
    final = messages[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return
    if isinstance(content, (list, tuple)):
        blocks = [dict(b) if isinstance(b, dict) else b for b in content]
        for block in reversed(blocks):
            if isinstance(block, dict) and "text" in block:
                block["text"] = block["text"] + _CONTINUE_TAG
                final["content"] = blocks
                return
    raise InvalidInputError("continue_final_message is set but the final message has no text to continue")


def _cut_at_tag(text: str) -> str:
    cut = text.rfind(_CONTINUE_TAG.strip())
    if cut < 0:
        raise InvalidInputError(
            "continue_final_message is set but the chat template dropped the final message's content"
        )
    if text[cut:cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:cut]
    # The template trimmed the message (e.g. `| trim`), so trailing spaces of the content are gone too.
    return text[:cut].rstrip()
