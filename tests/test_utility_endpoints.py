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


def test_apply_template_is_what_a_chat_completion_sees(server, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = post(server, "/apply-template", {"messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == str(model.apply_chat_template(msgs))
    assert r.json()["prompt"].rstrip().endswith("assistant")


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
