"""LLM.chat: conversations rendered by the chat template (the artifact's, or one given), then generated."""
import shutil

import pytest

import llmc
from llmc.errors import LLMCError, RequestError
from llmc.runtime.llm import LLM, SamplingParams

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONVERSATIONS = [[{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}],
                 [{"role": "user", "content": "import os"}]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_art(llama_dir, tmp_path_factory):
    """The tiny Llama with TEMPLATE as its tokenizer's chat template."""
    root = tmp_path_factory.mktemp("chat")
    shutil.copytree(llama_dir, root / "m")
    (root / "m" / "chat_template.jinja").write_text(TEMPLATE)
    return llmc.compile(root / "m", root / "m.llmc")


def test_chat_renders_as_transformers_and_generates_as_generate(chat_art, llama_dir):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(llama_dir))
    llm = LLM(chat_art, backend="reference", num_blocks=64)
    outs = llm.chat(CONVERSATIONS, GREEDY)
    for conv, out in zip(CONVERSATIONS, outs):
        ids = hf.apply_chat_template(conv, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert out.prompt_token_ids == list(ids)
        assert out.token_ids == llm.generate([list(ids)], GREEDY)[0].token_ids
    one = llm.chat(CONVERSATIONS[1], GREEDY)  # a single conversation
    assert len(one) == 1 and one[0].token_ids == outs[1].token_ids
    plain = llm.chat(CONVERSATIONS[1], GREEDY, chat_template="{{ messages[0].content }}",
                     add_generation_prompt=False)[0]
    assert plain.prompt_token_ids == llm.engine.encode("import os")


def test_chat_errors_say_what_to_fix(chat_art, llama_artifact):
    bare = LLM(llama_artifact, backend="reference", num_blocks=64)  # no chat template
    with pytest.raises(RequestError, match="no chat template.*chat_template="):
        bare.chat(CONVERSATIONS[1])
    llm = LLM(chat_art, backend="reference", num_blocks=64)
    with pytest.raises(RequestError, match=r"messages\[1\] must be a mapping with a string 'role'"):
        llm.chat([{"role": "user", "content": "x"}, {"role": "user"}])
    with pytest.raises(RequestError, match=r"messages\[1\] must be a non-empty list"):
        llm.chat([CONVERSATIONS[0], []])
    with pytest.raises(RequestError, match="the chat template refused messages: no system turns"):
        llm.chat(CONVERSATIONS[0], chat_template="{{ raise_exception('no system turns') }}")
    with pytest.raises(LLMCError, match="does not parse.*as chat_template="):
        llm.chat(CONVERSATIONS[0], chat_template="{% for %}")
    assert not llm.engine.has_unfinished()


def test_async_chat_streams_what_chat_returns(chat_art):
    import asyncio

    from llmc.runtime.async_engine import AsyncLLM
    want = LLM(chat_art, backend="reference", num_blocks=64).chat(CONVERSATIONS[0], GREEDY)[0]

    async def main():
        async with AsyncLLM(chat_art, backend="reference", num_blocks=64) as llm:
            last = None
            async for out in llm.chat(CONVERSATIONS[0], GREEDY):
                last = out
            with pytest.raises(RequestError, match="one conversation"):
                async for _ in llm.chat(CONVERSATIONS, GREEDY):
                    pass
            return last
    got = asyncio.run(main())
    assert got.finished and got.prompt_token_ids == want.prompt_token_ids and got.outputs[0].token_ids == want.token_ids
