"""Chat templates against transformers' own `apply_chat_template` on the same tokenizer files, and the end tokens."""

import json

import pytest
from tokenizers import Tokenizer

from cakemp.demo.synthetic import EOS, write_checkpoint
from cakemp.errors import CheckpointError
from cakemp.master.chat import ChatTemplate, TemplateRefused, conversation, end_token_ids
from tests.master.chat_templates import CHATML, LLAMA2, with_template

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    conversation("You are a helpful AI assistant.", "Once upon a time"),
    conversation("", "  a prompt with spaces, ünïcode and a tab\t "),
    [*conversation("Be brief.", "hello"), {"role": "assistant", "content": " the world said hello "},
     {"role": "user", "content": "and then?"}],
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    write_checkpoint(path)
    return path


def ours(directory):
    return ChatTemplate.load(directory, Tokenizer.from_file(str(directory / "tokenizer.json")))


@pytest.mark.parametrize(("template", "in_jinja_file"), [(LLAMA2, False), (CHATML, True)], ids=["llama2", "chatml"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["system", "no-system", "three-turns"])
def test_the_prompt_ids_are_transformers_apply_chat_template(base, tmp_path, template, in_jinja_file, messages):
    """tokenizer_config.json's template and chat_template.jinja's both give apply_chat_template's ids
    (add_generation_prompt=True) for the same tokenizer files."""
    directory = with_template(base, tmp_path / "ckpt", template, in_jinja_file)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours(directory).encode(messages) == list(expected)


def test_the_generation_tag_and_named_templates_are_read_as_transformers_reads_them(base, tmp_path):
    """A list of named templates gives the "default" one; its {% generation %} block renders its body."""
    tagged = CHATML.replace("{{- '<|im_start|>' + message.role", "{% generation %}{{- '<|im_start|>' + message.role")
    tagged = tagged.replace("'<|im_end|>\\n' }}", "'<|im_end|>\\n' }}{% endgeneration %}")
    directory = with_template(base, tmp_path / "ckpt", [{"name": "tool_use", "template": LLAMA2},
                                                         {"name": "default", "template": tagged}])
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    messages = CONVERSATIONS[2]
    assert "{% generation %}" in tagged
    assert ours(directory).encode(messages) == list(
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_a_template_refusing_the_messages_is_a_template_error(base, tmp_path):
    """Llama 2's template raises on two user turns in a row: TemplateRefused with its words."""
    template = ours(with_template(base, tmp_path / "ckpt", LLAMA2))
    with pytest.raises(TemplateRefused, match="roles must alternate"):
        template.encode([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_template_cannot_reach_python_internals(base, tmp_path):
    """The sandbox refuses attribute access into Python's internals (a template is untrusted code)."""
    template = ours(with_template(base, tmp_path / "ckpt", "{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(TemplateRefused, match="unsafe|not safely|access"):
        template.render(CONVERSATIONS[0])


def test_a_checkpoint_without_a_template_has_none_and_a_broken_one_is_refused(base, tmp_path):
    assert ours(base) is None
    with pytest.raises(CheckpointError, match="does not compile"):
        ours(with_template(base, tmp_path / "broken", "{% for m in messages %}"))


def test_the_end_tokens_are_config_generation_config_and_the_tokenizers_eos(base, tmp_path):
    """config.json's id, generation_config.json's list and tokenizer_config.json's eos_token, together."""
    directory = with_template(base, tmp_path / "ckpt")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    eos = tokenizer.token_to_id(EOS)
    assert end_token_ids(directory, tokenizer) == {eos}
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "eos_token": {"content": "<s>", "special": True}}))
    assert end_token_ids(directory, tokenizer) == {eos, 7, 9, tokenizer.token_to_id("<s>")}
