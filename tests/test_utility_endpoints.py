"""llama-server's utility endpoints on `pyllama-kv serve` (issue 33, item 5): /tokenize, /detokenize and
/apply-template in its request and answer shapes, checked against the library on the same model, and
their bad requests as 400s naming the field. One bounded server on 127.0.0.1 for the module."""
from __future__ import annotations

import httpx
import pytest

import pyllama_kv as pk
from test_server import MODEL, ServerProc


@pytest.fixture(scope="module")
def server(real_model, pin_lib):   # on each pin's library in turn
    with ServerProc(MODEL, "--lib", pin_lib, "--ctx", "512", "--parallel", "1") as s:
        yield s


@pytest.fixture(scope="module")
def model(real_model):
    with pk.Model(real_model) as m:
        yield m


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.root + path, json=body, headers=server.headers(), timeout=60)


def test_tokenize_and_detokenize_round_trip_as_the_library_does(server, model):
    text = "Hello, world! <|im_start|> caf\u00e9 \u4e2d\u6587"
    r = post(server, "/tokenize", {"content": text})
    assert r.status_code == 200, r.text
    toks = r.json()["tokens"]
    assert toks == model.tokenize(text, add_bos=False, special=True)
    assert post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"] == \
        model.tokenize(text, add_bos=True, special=True)
    assert post(server, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"] == \
        model.tokenize(text, add_bos=False, special=False)
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == toks
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined == b"".join(model.token_to_piece(t, special=True) for t in toks)
    r = post(server, "/detokenize", {"tokens": toks})
    assert r.status_code == 200 and r.json()["content"] == model.detokenize(toks, special=True) == text


#: what SmolLM2-Instruct's template (the catalogue's pinned file) renders for these conversations, with
#: the generation prompt: ChatML, and its own system prompt when the conversation has none
RENDERED = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! <b>"},
      {"role": "user", "content": "Caf\u00e9?"}],
     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! <b><|im_end|>\n"
     "<|im_start|>user\nCaf\u00e9?<|im_end|>\n<|im_start|>assistant\n"),
]


@pytest.mark.parametrize("i", range(len(RENDERED)))
def test_apply_template_renders_the_models_template(server, real_model, i):
    """/apply-template's prompt against expectations of its own: the literal rendering of the pinned
    model's template, and that template's text (the GGUF's tokenizer.chat_template) rendered by jinja2
    directly, as transformers renders chat templates (not through the server's sandbox and workers)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pyllama_kv.modelfile.gguf import read_gguf_header

    msgs, want = RENDERED[i]
    r = post(server, "/apply-template", {"messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == want
    source = read_gguf_header(real_model).kv["tokenizer.chat_template"].value
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert env.from_string(source).render(messages=msgs, add_generation_prompt=True) == want


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "extra": 1}, "extra"),
    ("/detokenize", {"tokens": [1, 2**40]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": [{"role": "user", "content": "x"}], "model": "m"}, "model"),
])
def test_bad_requests_are_400s_naming_the_field(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()
    assert server.proc.poll() is None


def test_they_need_the_api_key(server):
    r = httpx.post(server.root + "/tokenize", json={"content": "x"}, timeout=30)
    assert r.status_code == 401
