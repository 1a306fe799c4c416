"""Chat templates are never silently wrong: the model's own, a file, or the plain layout; else refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from foundation.errors import InvalidConfig
from generation.chat_template import bundled_templates, resolve_chat_template

NO_SYSTEM_CHATML = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHUNKS = [PromptChunk(7, 1, "The pump is inspected monthly."), PromptChunk(8, 2, "Valves: every five years.")]


@pytest.fixture(scope="module")
def tiktoken_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from generation.remote_tokenizer import load_tiktoken

    return load_tiktoken("cl100k_base", tmp_path_factory.mktemp("tiktoken"))


def test_the_models_own_template_is_used_and_its_end_of_turn_ends_answers(smollm_tokenizer: Any) -> None:
    b = PromptBuilder.for_tokenizer(smollm_tokenizer)
    assert b.template.origin == "model" and b.template.source == smollm_tokenizer.hf.chat_template
    assert b.end_of_turn_ids == [smollm_tokenizer.hf.convert_tokens_to_ids("<|im_end|>")]


def test_a_tokenizer_without_a_template_is_refused_with_the_setting_named(tiktoken_tok: Any) -> None:
    with pytest.raises(InvalidConfig) as err:
        PromptBuilder.for_tokenizer(tiktoken_tok)
    assert err.value.code == "no_chat_template" and "RAGBUDGET_CHAT_TEMPLATE" in err.value.message


def test_markers_that_are_not_special_tokens_are_refused(tiktoken_tok: Any) -> None:
    with pytest.raises(InvalidConfig) as err:
        PromptBuilder.for_tokenizer(tiktoken_tok, "chatml")
    assert err.value.code == "chat_template_mismatch" and err.value.details["marker"] == "<|im_start|>"


def test_the_plain_layout_has_no_markers_and_no_end_of_turn(tiktoken_tok: Any) -> None:
    b = PromptBuilder.for_tokenizer(tiktoken_tok, "plain")
    prompt = b.build(DEFAULT_SCAFFOLD_TEXT, CHUNKS, "When?")
    assert b.template.origin == "plain" and b.end_of_turn_ids == []
    assert prompt.text.startswith(DEFAULT_SCAFFOLD_TEXT + "\n\n[1] (doc 7 v1)\n")
    assert prompt.text.endswith("\n\nQuestion: When?\n\nAnswer:")
    assert prompt.ids[:prompt.scaffold_len] == b.scaffold_ids(DEFAULT_SCAFFOLD_TEXT)


def test_a_template_file_overrides_the_models_own(smollm_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "no_system.jinja"
    path.write_text(NO_SYSTEM_CHATML)
    b = PromptBuilder.for_tokenizer(smollm_tokenizer, str(path))
    assert (b.template.origin, b.template.name) == ("file", str(path))
    assert not b.framing.system_supported


def test_a_template_without_a_system_role_keeps_the_scaffold_first_and_cacheable(
        smollm_tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "no_system.jinja"
    path.write_text(NO_SYSTEM_CHATML)
    b = PromptBuilder.for_tokenizer(smollm_tokenizer, str(path))
    one = b.build(DEFAULT_SCAFFOLD_TEXT, CHUNKS[:1], "When?")
    two = b.build(DEFAULT_SCAFFOLD_TEXT, CHUNKS, "Why?")
    assert one.ids[:one.scaffold_len] == two.ids[:two.scaffold_len] == b.scaffold_ids(DEFAULT_SCAFFOLD_TEXT)
    assert smollm_tokenizer.decode(one.scaffold_ids).startswith("<|im_start|>user\n" + DEFAULT_SCAFFOLD_TEXT)
    assert one.messages[0]["role"] == "user" and len(one.messages) == 1


@pytest.mark.parametrize("setting", ["/no/such/template.jinja", "   "])
def test_a_missing_template_file_is_a_config_error_and_blank_means_unset(
        smollm_tokenizer: Any, setting: str) -> None:
    if setting.strip():
        with pytest.raises(InvalidConfig):
            resolve_chat_template(smollm_tokenizer, setting)
    else:
        assert resolve_chat_template(smollm_tokenizer, setting).origin == "model"


# --- a template must end the prompt by opening the assistant's turn ------------------------------
NO_GENERATION_PROMPT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                        "+ '<|im_end|>\\n' }}{% endfor %}")
WRONG_TURN = NO_GENERATION_PROMPT + "{% if add_generation_prompt %}{{ '<|im_start|>user\\n' }}{% endif %}"
PLAIN_ROLES_NO_GENERATION_PROMPT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(("template", "rule"), [(NO_GENERATION_PROMPT, "generation_prompt"),
                                                (WRONG_TURN, "assistant_turn")])
def test_a_template_that_cannot_open_the_assistant_turn_is_refused(
        smollm_tokenizer: Any, tmp_path: Path, template: str, rule: str) -> None:
    path = tmp_path / "custom.jinja"
    path.write_text(template)
    with pytest.raises(InvalidConfig) as err:
        PromptBuilder.for_tokenizer(smollm_tokenizer, str(path))
    assert err.value.code == "chat_template_no_assistant_turn" and err.value.details["rule"] == rule
    assert "add_generation_prompt" in err.value.message and "RAGBUDGET_CHAT_TEMPLATE" in err.value.message


def test_a_template_without_a_generation_prompt_is_refused_at_start_before_any_request(
        tmp_path: Path) -> None:
    from app.services import Services
    from app.settings import get_settings
    from tests.generation.fake_openai import FakeOpenAI

    path = tmp_path / "roles.jinja"
    path.write_text(PLAIN_ROLES_NO_GENERATION_PROMPT)
    with FakeOpenAI(["x"]) as server:
        settings = get_settings(data_dir=tmp_path, generator_backend="remote", chat_template=str(path),
                                remote_base_url=server.base_url, remote_model="fake-model",
                                remote_tokenizer="cl100k_base")
        with pytest.raises(InvalidConfig) as err:
            Services(settings).generator  # noqa: B018
        assert err.value.code == "chat_template_no_assistant_turn" and server.requests == []


def test_the_same_template_with_its_generation_prompt_is_accepted(smollm_tokenizer: Any,
                                                                  tmp_path: Path) -> None:
    path = tmp_path / "custom.jinja"
    path.write_text(NO_GENERATION_PROMPT + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                    "{% endif %}")
    builder = PromptBuilder.for_tokenizer(smollm_tokenizer, str(path))
    prompt = builder.build(DEFAULT_SCAFFOLD_TEXT, CHUNKS, "When?")
    assert prompt.text.endswith("When?<|im_end|>\n<|im_start|>assistant\n")


def test_the_bundled_family_templates_are_named_in_the_error() -> None:
    assert {"chatml", "gemma3"} <= set(bundled_templates())


# --- Gemma 3 270M: a base model whose GGUF carries no chat template ------------------------------
@pytest.mark.slow
def test_gemma_has_no_template_of_its_own_and_is_refused(gemma_tokenizer: Any) -> None:
    with pytest.raises(InvalidConfig) as err:
        PromptBuilder.for_tokenizer(gemma_tokenizer)
    assert err.value.code == "no_chat_template"


@pytest.mark.slow
def test_chatml_on_gemma_is_refused_instead_of_sent_as_text(gemma_tokenizer: Any) -> None:
    with pytest.raises(InvalidConfig) as err:
        PromptBuilder.for_tokenizer(gemma_tokenizer, "chatml")
    assert err.value.details["marker"] in ("<|im_end|>", "<|im_start|>")


@pytest.mark.slow
def test_gemma_family_template_folds_the_scaffold_into_the_first_user_turn(gemma_tokenizer: Any) -> None:
    b = PromptBuilder.for_tokenizer(gemma_tokenizer, "gemma3")
    hf = gemma_tokenizer.hf
    prompt = b.build(DEFAULT_SCAFFOLD_TEXT, CHUNKS, "When is the pump inspected?")
    assert b.end_of_turn_ids == [hf.convert_tokens_to_ids("<end_of_turn>")]
    assert gemma_tokenizer.decode(prompt.scaffold_ids) == (
        "<bos><start_of_turn>user\n" + DEFAULT_SCAFFOLD_TEXT + "\n\n")
    assert prompt.ids[:prompt.scaffold_len] == b.scaffold_ids(DEFAULT_SCAFFOLD_TEXT)
    assert gemma_tokenizer.decode(prompt.ids).endswith("<end_of_turn>\n<start_of_turn>model\n")
    # the same ids as the family template rendered whole and tokenized in one go
    rendered = hf.apply_chat_template(prompt.messages, chat_template=b.template.source, tokenize=False,
                                      add_generation_prompt=True)
    assert hf(rendered, add_special_tokens=False)["input_ids"] == prompt.ids


@pytest.mark.slow
def test_gemma_plain_layout_starts_with_its_bos(gemma_tokenizer: Any) -> None:
    b = PromptBuilder.for_tokenizer(gemma_tokenizer, "plain")
    prompt = b.build(DEFAULT_SCAFFOLD_TEXT, CHUNKS, "When?")
    assert prompt.ids[0] == gemma_tokenizer.hf.bos_token_id and prompt.ids.count(prompt.ids[0]) == 1
    assert b.end_of_turn_ids == []


@pytest.mark.slow
def test_a_chat_models_gguf_path_is_converted_once_and_keeps_its_own_template(tmp_path: Path) -> None:
    from generation.assets import generator_dir, load_tokenizer, packaged_gguf_path
    from retrieval.tokens import HFTextTokenizer

    first = generator_dir(tmp_path, str(packaged_gguf_path()))
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = generator_dir(tmp_path, str(packaged_gguf_path()))
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert (first / "SOURCE").read_text().splitlines()[0] == packaged_gguf_path().name
    tok = HFTextTokenizer(load_tokenizer(first), name=str(first))
    b = PromptBuilder.for_tokenizer(tok)
    assert b.template.origin == "model" and "<|im_start|>" in (b.template.source or "")
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]
