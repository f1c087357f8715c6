"""The limits and type tables of the library, each written once.

Every module that bounds a value imports it from here: the dataclasses of :mod:`pyllama_kv.config`
(``ContextConfig``, ``EngineConfig``, ``SamplingParams``), the context, the engine, the HTTP protocol,
the CLI and the tools. A limit that two layers apply differently says why, here, in one comment.
A leaf module: it imports nothing (not numpy), so the CLI can read it to write its --help.
"""
from __future__ import annotations

# -- integers as llama.cpp stores them ----------------------------------------------------------

INT32_MAX = 2**31 - 1      # llama.cpp's int32_t: token ids, positions, counts of cells, tokens and layers
INT32_MIN = -(2**31)
UINT32_MAX = 2**32 - 1     # a uint32 in a GGUF file; sampling seeds (llama_sampler_init_dist)

# -- a context ----------------------------------------------------------------------------------

#: sequence ids of one context (``n_seq_max``; the engine's ``parallel + prefix_cache``). Our bound
#: (llama.cpp at the pin has none; later releases' LLAMA_MAX_SEQ is the same 256).
MAX_SEQUENCES = 256
#: threads of one context (GGML_MAX_N_THREADS, ggml.h)
MAX_THREADS = 512
#: the KV cache cells of a context, an engine and the stress workload when none is asked for
DEFAULT_N_CTX = 2048


def default_n_ctx(n_ctx_train: int) -> int:
    """The context the commands (run, chat, serve) make when ``--ctx`` is not given: DEFAULT_N_CTX
    cells, or the model's training context when that is smaller (a larger one is refused)."""
    return max(1, min(DEFAULT_N_CTX, int(n_ctx_train)))


#: the KV cache types a context may use (llama.cpp's ``--cache-type-k/-v`` choices, common/arg.cpp), in
#: its order: name -> ggml type id. Block sizes and bytes per block are ggml's (``gguf.GGML_TYPES``).
KV_CACHE_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20,
                                  "q5_0": 6, "q5_1": 7}
#: the quantized ones (every type but the floats; blocks of 32 values): a quantized V cache needs flash
#: attention, and a quantized cache a head size that is a multiple of its block
QUANTIZED_KV_TYPES: frozenset[str] = frozenset(KV_CACHE_TYPES) - {"f32", "f16", "bf16"}


def kv_type_block(name: str) -> int:
    """Values per block of KV cache type ``name`` (1 for f32, f16, bf16); KeyError for another name."""
    from .modelfile.gguf import GGML_TYPES  # (it imports numpy: not at this module's import)

    return GGML_TYPES[KV_CACHE_TYPES[name]][1]


def kv_type_size(name: str) -> float:
    """Bytes per value of KV cache type ``name`` (a block type's averaged over its block); KeyError for
    another name."""
    from .modelfile.gguf import GGML_TYPES

    _name, block, size = GGML_TYPES[KV_CACHE_TYPES[name]]
    return size / block


#: llama.cpp's pooling types (llama.h's ``enum llama_pooling_type``), by the names llama-server's
#: ``--pooling`` takes: how an embeddings context turns a sequence's token vectors into one vector
#: (``rank``: a reranker's classification head on the first token; ``none``: one vector per token)
POOLING_TYPES: dict[str, int] = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
#: inputs of one embedding call or request (OpenAI's bound on /v1/embeddings' ``input`` array), and
#: documents of one rerank request
MAX_EMBED_INPUTS = 2048

# -- a request ----------------------------------------------------------------------------------

#: temperature: the library takes [0, TEMPERATURE_MAX] (llama.cpp takes any; past a few the draw is
#: all but uniform), while the HTTP API keeps to OpenAI's documented [0, OPENAI_TEMPERATURE_MAX], so
#: that a request valid here is valid at OpenAI and the reverse
TEMPERATURE_MAX = 100.0
OPENAI_TEMPERATURE_MAX = 2.0
#: OpenAI's ranges, the library's too: frequency and presence penalties in [-PENALTY_MAX, PENALTY_MAX],
#: a logit bias in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]; llama.cpp's repeat penalty in (0, REPEAT_PENALTY_MAX]
PENALTY_MAX = 2.0
LOGIT_BIAS_MAX = 100.0
REPEAT_PENALTY_MAX = 10.0
#: stop strings of one request (the engine's bound, and the HTTP API's 400)
MAX_STOP_STRINGS = 16
#: a grammar or schema a request carries (pyllama_kv.sampling.grammar_check measures it before llguidance sees it):
#: characters of its text; rules (or schema objects); levels of chained references and nesting. llguidance
#: 1.9 overflows its native stack at ~2,500 chained ``$defs`` and ~2,800 chained Lark rules, and its GBNF
#: converter is superlinear in chain length (0.33 s at 500, 6.5 s at 2,000): the depth bound is 5x below
#: the first crash and keeps a conversion well under a second
GRAMMAR_MAX_CHARS = 256 * 1024
GRAMMAR_MAX_RULES = 4000
GRAMMAR_MAX_DEPTH = 500
#: a grammar's first compilation runs in a worker process (pyllama_kv._worker): killed past
#: GRAMMAR_TIME_LIMIT seconds, under GRAMMAR_MEMORY_LIMIT bytes of address space (a vocabulary of 150k
#: tokens and llguidance's lexer take a few hundred MiB)
GRAMMAR_TIME_LIMIT = 10.0
GRAMMAR_MEMORY_LIMIT = 2 << 30


def prompt_too_long(n_prompt: int, n_ctx: int) -> str | None:
    """None when a prompt of ``n_prompt`` tokens fits a context of ``n_ctx`` cells, else why not, in
    the words the engine, the server and the CLI each add their remedy to: at least one cell more than
    the prompt is needed, for the first generated token."""
    if n_prompt < n_ctx:
        return None
    return (f"the prompt has {n_prompt} tokens; the context holds {n_ctx} (and at least one more is needed "
            "to generate)")

# -- what one HTTP request may carry (pyllama_kv.server: counted before any per-item work) ------------------

#: messages of one chat request: a chat completion's ``messages`` (and /apply-template's), a Responses
#: request's ``input`` items (with the conversation its ``previous_response_id`` continues), a Messages
#: request's ``messages`` (and /v1/messages/count_tokens'). Each is rendered by the chat template (in its
#: sandbox, under its step and time limits), so a request past the bound is refused with a 400 naming the
#: field before any of its items is looked at, whatever the body's size: OpenAI documents no bound, and
#: this one is far above a conversation that fits a context (every message takes a few tokens at least)
MAX_MESSAGES = 4096
#: content parts (text parts, Anthropic's content blocks) and tool calls of one message: joined into one
#: string, or rendered one by one (calls), so bounded like messages
MAX_MESSAGE_PARTS = 4096
#: control-token spellings (``<|im_end|>`` typed in a message) one rendered chat may carry: each is
#: tokenized on its own as plain text (llama_tokenize costs ~70 us a call here, whatever the text's
#: length), so 1 MiB of them took 11 s to tokenize and stalled other clients; far above a chat that
#: quotes a template or a log
MAX_CONTROL_TEXTS = 1024

# -- the server's stored responses (POST /v1/responses with store: true) ---------------------------------

#: responses kept for ``previous_response_id`` (least recently used first out) and the memory they may
#: hold together (their conversations and answers): each is kept as compact JSON (bytes) and counted by
#: the memory those bytes take, with RESPONSES_ENTRY_BYTES for its id and place in the table, so the
#: store holds at most RESPONSES_STORED_BYTES whatever the shapes in it (nested empty lists, many tiny
#: keys, long strings: measured in tests/test_hostile_requests.py); a response over the bound is not kept
RESPONSES_STORED = 1024
RESPONSES_STORED_BYTES = 64 << 20
RESPONSES_ENTRY_BYTES = 512

# -- checkpoints where prompts branch (pyllama_kv.prefixcache.checkpoints, PrefixCache.keeps_checkpoints) --

#: the fewest tokens a checkpoint follows: a shorter boundary is not worth a cut of the prompt's
#: evaluation, nor (a sliding-window model) an idle sequence and its id (a template that renders a
#: system message into the first user turn gives a system-prompt boundary of just BOS)
CHECKPOINT_MIN_TOKENS = 16

#: the host memory the prefix cache's checkpoints of recurrent state may take together (least recently
#: used first out): a 1B hybrid's state is a few hundred KiB, a 30B gated-delta-net's tens of MiB
CHECKPOINT_BYTES = 256 << 20

#: a recurrent model's long prompt also keeps a checkpoint every CHECKPOINT_INTERVAL tokens (the last
#: CHECKPOINT_PERIODIC of them): a branch where no exact checkpoint is forks from the last one before it
#: (engine/kv.py's periodic_points; a tiny LFM2's raw completion branching at ~1,100 cached tokens reused
#: nothing without them)
CHECKPOINT_INTERVAL = 256
CHECKPOINT_PERIODIC = 8

# -- idle prefixes in the cells (engine/kv.py's ContextKV.page_out_idle) ------------------------------
#: llama.cpp attends over every cell up to the highest one in use, masked or not, for every token a
#: decode evaluates, so an idle cached prefix left in the cells costs the running requests' every
#: token about a read of its K and V: a copy to the host tier costs that once. One not used while the
#: engine decoded IDLE_PAGE_OUT_TOKENS tokens (a prompt chunk counts all its tokens) is paged out
#: (where the host tier is on; restored by a copy when a prompt comes back to it), before the decode
#: that reaches the bound (looked at every IDLE_PAGE_OUT_TOKENS // 2 tokens or more): a prompt chunk's
#: step then neither attends over its cells nor places the chunk above them. SmolLM2-135M, one
#: sequence decoding: 16.5 ms a token alone, 32.8 ms beside 3,500 idle cells; 8 agents prompts after
#: the code load's conversations: 1.1 s a step against 0.36 s on an empty cache.
IDLE_PAGE_OUT_TOKENS = 32
#: an idle prefix whose cells running sequences do not share counts when it holds this many of its own
IDLE_PAGE_OUT_MIN = 64

# -- model stores read in place (pyllama_kv.modelfile.local, .names, .hub: issue 45) -------------------

#: bytes of a small file of a model store that is read whole: an Ollama manifest (about 1 KiB for a
#: model of a few layers), LM Studio's settings.json and home pointer, a Hugging Face cache ref (a
#: 40-byte commit). A larger one is refused from its size (os.stat), never read: a 1 GB manifest took
#: 8 s and 2.1 GB of memory to be refused by the JSON parser
STORE_FILE_MAX_BYTES = 256 * 1024
#: levels of nesting of such a JSON file (an Ollama manifest has 3: the manifest, its layers, a layer),
#: checked before it is parsed: CPython's parser recurses, and ~1,000 levels are a RecursionError
STORE_JSON_MAX_DEPTH = 32

# -- speculative decoding (pyllama_kv.speculation, engine/speculate.py: issue 47) ------------------------

#: the draft sources EngineConfig.spec (and `--spec`) names: a continuation's own tokens (prompt
#: lookup) and every conversation the engine finished (the cache's suffix index)
SPEC_SOURCES = ("ngram", "cache")
#: the most draft tokens one continuation gets in a step (EngineConfig.spec_max's bound)
SPEC_MAX_DRAFT = 64
#: tokens of finished conversations the cache source indexes (the oldest go first; ~50 bytes a token)
SPEC_INDEX_TOKENS = 1 << 20

# -- KV events (serve --kv-events) --------------------------------------------------------------------

#: the most tokens a KV-event block may hold (``serve --kv-events-block-size``; vLLM's default is 16)
KV_EVENT_BLOCK_MAX = 4096
