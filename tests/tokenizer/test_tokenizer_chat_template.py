"""weld's chat templates render exactly what HF's `apply_chat_template(tokenize=False)` renders."""

import pytest
import tokenizers

from weld.tokenizer import Tokenizer
from weld.utils.errors import InvalidInputError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer with <b>html</b> & \"quotes\"."},
]

# A template in the style of tool-calling models: tools as JSON, a guard using raise_exception,
# loop controls, and a {% generation %} block as HF templates for training use.
TOOLS_TEMPLATE = """\
{%- if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}
{{- bos_token }}<|system|>{{ messages[0].content }}
{%- if tools %}
Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{%- endif %}
{%- for m in messages[1:] %}
{%- if m.role == 'skip' %}{% continue %}{% endif %}
<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{% if think %}<think>{% endif %}
{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & \"later\"",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _hf_render(hf, messages, **kwargs):
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_hf(weld_smollm2, hf_smollm2, add_generation_prompt):
    assert weld_smollm2.chat_template == hf_smollm2.chat_template
    for messages in (CONVERSATION, CONVERSATION[1:]):  # without a system message the template adds one
        expected = _hf_render(hf_smollm2, messages, add_generation_prompt=add_generation_prompt)
        assert weld_smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_matches_hf(weld_smollm2, hf_smollm2):
    messages = CONVERSATION + [{"role": "assistant", "content": "The answer is "}]
    expected = _hf_render(hf_smollm2, messages, continue_final_message=True)
    assert expected.endswith("<|im_start|>assistant\nThe answer is ")
    assert weld_smollm2.apply_chat_template(messages, add_generation_prompt=False,
                                            continue_final_message=True) == expected
    # The generation prompt cannot apply when continuing a message; weld's default does not get in the way.
    assert weld_smollm2.apply_chat_template(messages, continue_final_message=True) == expected
    assert messages[-1]["content"] == "The answer is "  # the caller's messages are untouched


def _with_template(tokenizer, template):
    return Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
                     chat_template=template, vocab_size=tokenizer.vocab_size)


def test_tools_template_matches_hf(weld_smollm2, hf_smollm2):
    weld = _with_template(weld_smollm2, TOOLS_TEMPLATE)
    messages = CONVERSATION[:2] + [{"role": "skip", "content": "x"}] + CONVERSATION[2:]
    for kwargs in ({}, {"think": True}, {"add_generation_prompt": False}):
        hf_kwargs = {"add_generation_prompt": True, **kwargs}
        expected = _hf_render(hf_smollm2, messages, tools=TOOLS, chat_template=TOOLS_TEMPLATE, **hf_kwargs)
        assert weld.apply_chat_template(messages, tools=TOOLS, **kwargs) == expected
    assert '"Weather <now> & \\"later\\""' in expected  # tojson does not HTML-escape


def test_raise_exception_becomes_invalid_input(weld_smollm2):
    weld = _with_template(weld_smollm2, TOOLS_TEMPLATE)
    with pytest.raises(InvalidInputError, match="first message must be system"):
        weld.apply_chat_template(CONVERSATION[1:])


def test_broken_templates_are_invalid_input(weld_smollm2):
    with pytest.raises(InvalidInputError, match="syntax"):
        _with_template(weld_smollm2, "{% for m in messages %}").apply_chat_template(CONVERSATION)
    with pytest.raises(InvalidInputError):
        _with_template(weld_smollm2, "{{ messages[0].content + 1 }}").apply_chat_template(CONVERSATION)
    with pytest.raises(InvalidInputError, match="no chat template"):
        _with_template(weld_smollm2, None).apply_chat_template(CONVERSATION)


def test_template_runs_sandboxed(weld_smollm2):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidInputError):
        _with_template(weld_smollm2, evil).apply_chat_template(CONVERSATION)


def test_strftime_now_is_available():
    template = "{{ strftime_now('%Y') }}"
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    weld = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), chat_template=template)
    assert weld.apply_chat_template([]).isdigit()
