"""The ChatML chat template of the tiny model: system, user, assistant (with tool calls) and tool turns.

With ``tools`` it lists them in the system turn in the Hermes ``<tool_call>`` format that
:mod:`agl.engines.builtin.tools` parses. Kept in Python (not a data file) so it ships in any install.
"""

from __future__ import annotations

CHAT_TEMPLATE = """{%- set ns = namespace(first=0) -%}
{%- if tools -%}
<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}

{% set ns.first = 1 %}{% endif %}# Tools
You may call one or more functions. Function signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, reply with <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% endif -%}
{%- for message in messages[ns.first:] -%}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% elif message.content %}{% for part in message.content %}{{ part.text }}{% endfor %}{% endif %}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
{% if message.content or not loop.first %}
{% endif %}<tool_call>{"name": "{{ call.name }}", "arguments": {% if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}{% endif %}}</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""
