"""The model architectures each llama.cpp API generation implements (``LLM_ARCH_NAMES`` of its
``src/llama-arch.cpp``), as ``Caps.architectures`` reports them: a GGUF file's architecture is
checked against the loaded library's, and one the loaded library lacks but the other has gets a hint.

Regenerate on a pin move (``tests/test_ffi_header.py`` compares them with the vendored trees).
"""
from __future__ import annotations

# vendor/llama.cpp (8733e0c)
MISSION = frozenset("""
llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert nomic-bert
nomic-bert-moe jina-bert-v2 bloom stablelm qwen qwen2 qwen2moe qwen2vl qwen3 qwen3moe phi2 phi3
phimoe plamo codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3 starcoder2 mamba xverse
command-r cohere2 dbrx olmo olmo2 olmoe openelm arctic deepseek deepseek2 chatglm glm4 bitnet t5
t5encoder jais nemotron exaone rwkv6 rwkv6qwen2 rwkv7 arwkv7 granite granitemoe chameleon
wavtokenizer-dec plm bailingmoe
""".split())

# vendor/llama.cpp-current (0c1e57098)
CURRENT = frozenset("""
clip llama llama4 deci falcon grok gpt2 gptj gptneox mpt baichuan starcoder refact bert modern-bert
nomic-bert nomic-bert-moe neo-bert jina-bert-v2 jina-bert-v3 eurobert bloom stablelm qwen qwen2
qwen2moe qwen2vl qwen3 qwen3moe qwen3next qwen3vl qwen3vlmoe qwen35 qwen35moe qwen4exp phi2 phi3
phimoe plamo plamo2 plamo3 codeshell orion internlm2 minicpm minicpm3 gemma gemma2 gemma3 gemma3n
gemma4 gemma4-assistant gemma-embedding starcoder2 mamba mamba2 maple jamba falcon-h1 xverse
command-r cohere2 cohere2moe dbrx olmo olmo2 olmoe muse-glimmer openelm arctic deepseek deepseek2
deepseek2-ocr deepseek32 deepseek4 chatglm glm4 glm4moe glm-dsa bitnet t5 t5encoder jais jais2
nemotron nemotron_h nemotron_h_moe exaone exaone4 exaone-moe rwkv6 rwkv6qwen2 rwkv7 arwkv7 granite
granitemoe granitehybrid graniteswitch granite_swa chameleon wavtokenizer-dec plm bailingmoe
bailingmoe2 bailingmoe3 dots1 dots3note arcee afmoe laguna ernie4_5 ernie4_5-moe hunyuan-moe
hunyuan-dense hunyuan_vl hy_v3 hy_v4 smollm3 gpt-oss lfm2 lfm2moe dream smallthinker llada llada-moe
seed_oss grovemoe apertus minimax-01 hrm_text minimax-m2 minimax-m3 cogvlm rnd1 pangu-embedded
mistral3 eagle3 dflash mistral4 paddleocr mimo2 step35 spark2_5 llama-embed maincoder kimi-linear
kimi-k3 glm5-next talkie mellum nanbeige qwen3tts pockettts
""".split())

#: the pre-tokenizers (``tokenizer.ggml.pre`` of a BPE vocabulary, ``tokenizer.ggml.model`` "gpt2") each
#: generation's ``src/llama-vocab.cpp`` knows: llama.cpp refuses to load a BPE model with another one
PRE_MISSION = frozenset("""
bailingmoe bloom chameleon chatglm-bpe codeshell command-r dbrx deepseek-coder deepseek-llm
deepseek-r1-qwen deepseek-v3 default exaone falcon falcon3 gigachat glm4 gpt-2 gpt-4o gpt3-finnish
jais jina-de jina-es jina-v1-en jina-v2-code jina-v2-de jina-v2-es llama-bpe llama-v3 llama3 llama4
megrez minerva-7b mpt olmo phi-2 pixtral poro-chat qwen2 refact roberta-bpe smaug-bpe smollm
stablelm2 starcoder superbpe tekken trillion viking
""".split())

PRE_CURRENT = frozenset("""
a.x-4.0 afmoe bailingmoe bailingmoe2 bloom chameleon chatglm-bpe codeshell cohere2moe command-r dbrx
deepseek-coder deepseek-llm deepseek-r1-qwen deepseek-v3 default exaone exaone-moe exaone4 f2llmv2
falcon falcon-h1 falcon3 gemma4 gigachat glm4 glm5 gpt-2 gpt-4o gpt3-finnish granite-docling
granite-embed-multi-311m granite-embed-multi-97m grok-2 hunyuan hunyuan-dense hy_v4 jais jais-2
jina-de jina-es jina-v1-en jina-v2-code jina-v2-de jina-v2-es jina-v5-nano joyai-llm kanana2 kimi-k2
kormo laguna lfm2 llada-moe llama-bpe llama-v3 llama3 llama4 megrez mellum mellum2 midm-2.0
minerva-7b minicpm5 minimax-m2 modern-bert mpt olmo phi-2 pixtral poro-chat qwen2 qwen35 refact
roberta-bpe sarvam-moe seed-coder smaug-bpe smollm solar-open spark2_5 stablelm2 starcoder superbpe
talkie tekken tiny_aya trillion ufakzeka viking whitespace youtu
""".split())

#: architectures with layers that apply no RoPE, which llama.cpp's K-shift rotates all the same (both
#: pins: the current one skips only the layers ``{arch}.attention.rope_pattern`` marks, which these
#: never read; smollm3 leaves RoPE out of every 4th layer, llama4 and afmoe of every
#: ``n_no_rope_layer_step``-th): a K-shift of their cache continues wrongly, so they re-evaluate
NOPE_LAYERS = frozenset(("smollm3", "llama4", "afmoe"))

#: api generation -> (its architectures, the ``lib`` that loads it)
BY_API: dict[str, tuple[frozenset, str]] = {"mission": (MISSION, "patched"), "current": (CURRENT, "current")}
#: api generation -> its pre-tokenizers
PRE_BY_API: dict[str, frozenset] = {"mission": PRE_MISSION, "current": PRE_CURRENT}


def implements(api: str, arch: str | None, pre: str | None = None) -> bool:
    """Whether llama.cpp of generation ``api`` loads a model of architecture ``arch`` whose BPE
    vocabulary has pre-tokenizer ``pre`` (None: no BPE pre-tokenizer to check)."""
    return arch in BY_API[api][0] and (pre is None or pre in PRE_BY_API[api])


def loads_with(arch: str | None, pre: str | None = None) -> list[str]:
    """The ``lib`` values whose llama.cpp loads such a model, the default library's first."""
    return [lib for api, (_names, lib) in BY_API.items() if implements(api, arch, pre)]
