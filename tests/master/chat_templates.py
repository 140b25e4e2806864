"""Chat templates as model repositories write them, for checkpoints made in tests.

`LLAMA2` is Llama 2 chat's (tokenizer_config.json's `chat_template`: a system block folded into
the first user turn, `raise_exception` on roles out of order, `bos_token`/`eos_token`); `CHATML`
is a ChatML template as Qwen's repositories ship it in `chat_template.jinja` (whitespace control,
`loop.first`, a default system message), its markers written as text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

CHATML = """\
{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a small model.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def with_template(base: Path, directory: Path, template: str | list = LLAMA2, in_jinja_file: bool = False) -> Path:
    """A copy of the checkpoint `base` (the synthetic one, say) carrying `template`: in
    tokenizer_config.json's `chat_template`, or in chat_template.jinja."""
    shutil.copytree(base, directory)
    if in_jinja_file:
        (directory / "chat_template.jinja").write_text(template)
    else:
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "chat_template": template}, indent=2))
    return directory
