"""Multi-turn conversations whose tokens stay stable from turn to turn, so that a KV cache's prefix
reuse is exact (`pyllama-kv chat`, `run --chat`; the server's chats next).

A chat renders the whole conversation with the model's template every turn. Tokenizing that text
from scratch is not enough for prefix reuse: BPE may merge the end of an answer with what the
template writes after it differently than the model generated it ("Hel" + "lo" generated, "Hello"
re-tokenized), so the new prompt would not start with the tokens the cache holds, and every turn
would evaluate the conversation again from where they differ.

**The token-stability contract.** :meth:`Conversation.next_prompt` returns a prompt whose tokens
start with :attr:`Conversation.tokens` -- the token ids submitted and generated so far, as the cache
holds them (less what truncation and context shifts dropped) -- followed by the tokens of the newly
rendered text only, as llama.cpp's own chat does. That holds whenever

* the previous turn was recorded with :meth:`Conversation.answered` with ``cells_kept=True`` (the
  engine kept the turn's cells: finish reason ``eos``, ``length`` or ``stop``), and
* the template renders the earlier turns the same way again (the old rendering is a prefix of the
  new one).

Otherwise (a template that trims or rewrites the past, or an answer whose cells were freed) the
whole text is tokenized, and the prefix cache reuses what still matches: correct, only slower.
Control tokens come only from the template: text from the messages is tokenized with special-token
parsing off (:func:`pyllama_kv.chat.templates.tokenize_rendered`).

>>> conv = Conversation(ChatTemplate(model), system="Be brief.")
>>> turn = conv.next_prompt("Hello")
>>> h = engine.submit(turn.tokens, params, keep=True, boundaries=conv.next_boundaries, n_keep=conv.n_keep)
>>> engine.run_until_idle(); c = h.completions[0]
>>> conv.answered(*turn, c, cells_kept=c.finish_reason in ("eos", "length", "stop"))
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import InvalidInputError

__all__ = ["ChatTemplate", "Conversation", "Transcripts", "Turn"]


class ChatTemplate:
    """Renders messages with the model's chat template, or with ``source`` (another template's text,
    rendered in the same sandbox with the model's BOS/EOS texts), and tokenizes what it rendered.

    InvalidInputError when the model has no template and no ``source`` is given, or when the template
    fails or is refused: it renders one message when made, so that a broken or hostile template
    fails here, before any conversation starts. ``name`` names the template in messages."""

    def __init__(self, model, source: str | None = None, name: str | None = None):
        self.model = model
        self.source = source
        self.name = name or "the template"
        if source is None and model.chat_template is None:
            raise InvalidInputError(f"{model.path.name} has no chat template (no tokenizer.chat_template in the GGUF)")
        self.render([{"role": "user", "content": "hello"}])

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The text of ``messages`` (pyllama_kv.chat.templates.apply_chat_template: sandboxed, time-limited)."""
        from .templates import apply_chat_template

        return apply_chat_template(self.model, messages, add_generation_prompt, source=self.source, name=self.name)

    def tokenize(self, text: str, start: bool = True) -> list[int]:
        """Tokens of rendered ``text``, special tokens parsed only where the template wrote them; at
        the ``start`` of a prompt the model's BOS is added unless the template wrote it already."""
        from .templates import tokenize_rendered

        return tokenize_rendered(self.model, text, start)

    def prompt(self, user: str, system: str | None = None) -> list[int]:
        """One user message (after the system prompt, if any) as a prompt for an answer."""
        msgs = ([{"role": "system", "content": system}] if system is not None else [])
        return self.tokenize(self.render(msgs + [{"role": "user", "content": user}]))


class Turn(NamedTuple):
    """The next prompt of a conversation (:meth:`Conversation.next_prompt`): the messages with the new
    user message, their rendered text, and its tokens (which start with the conversation's tokens,
    see the module docstring)."""

    messages: list[dict]
    text: str
    tokens: list[int]


class Conversation:
    """The messages of a chat, and the token ids (and their text) the KV cache holds for them.

    ``tokens`` is what was submitted and generated, in order (less what truncation and context shifts
    dropped); ``text`` the rendering they stand for; ``boundaries`` where each turn starts in
    ``tokens`` (where truncation prefers to cut); ``n_keep`` the tokens before the first turn (BOS
    and the system prompt: what truncation and shifts should keep), known after the first prompt.
    Not thread-safe: one conversation is driven by one caller."""

    def __init__(self, template: ChatTemplate, system: str | None = None):
        self.template = template
        self.system = system
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system is not None else []
        self.tokens: list[int] = []
        self.text = ""
        self.boundaries: list[int] = []
        self.n_keep: int | None = None
        self.next_boundaries: list[int] = []   # ``boundaries`` of the prompt next_prompt made

    def next_prompt(self, user: str) -> Turn:
        """The messages, rendered text and tokens of the next turn: the tokens kept so far plus the
        tokens of the newly rendered text only (if the template renders the past as it was), else the
        whole text tokenized. Sets ``next_boundaries`` (and ``n_keep`` on the first turn)."""
        msgs = self.messages + [{"role": "user", "content": user}]
        text = self.template.render(msgs)
        if self.tokens and text.startswith(self.text):
            start = len(self.tokens)
            toks = self.tokens + self.template.tokenize(text[len(self.text):], start=False)
            bounds = list(self.boundaries)
        else:
            start = 0
            toks = self.template.tokenize(text)
            bounds = []
        turn = self._turn_start(text, toks, start)
        if turn is not None:
            bounds.append(turn)
            if self.n_keep is None and not self.boundaries:
                self.n_keep = turn
        elif start:
            bounds.append(start)
        self.next_boundaries = bounds
        return Turn(msgs, text, toks)

    def _turn_start(self, text: str, toks: list[int], start: int) -> int | None:
        """Where the new user turn starts in ``toks``: after the conversation so far as the template
        closes it (render without the generation prompt), when its tokens are a prefix there."""
        try:
            head = self.template.render(self.messages, add_generation_prompt=False) if self.messages else ""
        except Exception:   # a template that refuses a conversation ending there: no boundary
            return None
        if not text.startswith(head):
            return None
        if start:
            if not head.startswith(self.text):
                return None
            closing = self.template.tokenize(head[len(self.text):], start=False) if len(head) > len(self.text) else []
        else:
            closing = self.template.tokenize(head, start=True)
        if toks[start:start + len(closing)] != closing or start + len(closing) >= len(toks):
            return None
        return start + len(closing)

    def answered(self, msgs: list[dict], text: str, toks: list[int], completion: Any, cells_kept: bool) -> None:
        """Record the answer to the turn (``msgs``, ``text``, ``toks``: what :meth:`next_prompt`
        returned). ``completion`` is the engine's Completion (its ``text``, ``tokens`` and, when the
        engine kept the sequence, ``context_tokens`` and ``boundaries``: what the cells hold after
        truncation and shifts). ``cells_kept``: the turn's cells stay cached (the answer finished by
        ``eos``, ``length`` or ``stop``), so the next prompt starts with exactly their tokens; False
        (cancelled, failed) tokenizes the answer as text next turn."""
        self.messages = msgs + [{"role": "assistant", "content": completion.text}]
        kept = getattr(completion, "context_tokens", None)
        if cells_kept and kept is not None:
            # what the engine's sequence holds (less what truncation and shifts dropped), the answer
            # included: the next turn starts with it and reuses the cached cells
            self.tokens, self.text = list(kept), text + completion.text
            self.boundaries = list(completion.boundaries or [])
        elif cells_kept:   # the answer's tokens are in the cache (its last one is evaluated next turn)
            self.tokens, self.text = toks + list(completion.tokens), text + completion.text
            self.boundaries = list(self.next_boundaries)
        else:            # its cells were freed (Ctrl-C, error): the answer is tokenized as text next turn
            self.tokens, self.text = toks, text
            self.boundaries = list(self.next_boundaries)


class Transcripts:
    """Token-stable chats for a server, whose clients send the whole chat every time.

    A server renders each chat request's messages anew. After an answer, :meth:`remember` keeps the
    rendered prompt plus the answer's text with the exact tokens the cache holds for them (the prompt's
    and the generated ones); :meth:`tokenize` of a later rendering that starts with a remembered text
    returns those tokens plus the tokens of the new text only, as :class:`Conversation` does for one
    chat. So the next turn of a chat over HTTP starts with exactly the cached cells, instead of
    differing where re-tokenizing the answer would merge differently (and evaluating from there).

    Safe with untrusted messages: a remembered text is only used where the new rendering has the same
    ``plain`` spans (control-token text that came from the messages, :class:`pyllama_kv.chat.templates.Rendered`)
    inside it, so message text that spells what the template wrote never takes the template's control
    tokens; answers with a control token among their tokens are not remembered. Bounded: at most
    ``max_entries`` transcripts and ``max_chars`` characters, least recently used dropped first.
    Thread-safe."""

    def __init__(self, model, max_entries: int = 512, max_chars: int = 8 << 20):
        import threading
        from collections import OrderedDict

        self.model = model
        self.max_entries, self.max_chars = int(max_entries), int(max_chars)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = OrderedDict()
        self._chars = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def tokenize(self, text) -> list[int]:
        """The tokens of ``text`` (a rendering, :func:`pyllama_kv.chat.templates.apply_chat_template`): a
        remembered transcript's tokens for the longest remembered start of it, then the rest's tokens;
        else all of it tokenized (:func:`pyllama_kv.chat.templates.tokenize_rendered`)."""
        from .templates import tokenize_rendered

        raw = str.__str__(text)
        plain = tuple(getattr(text, "plain", ()))
        best: tuple[str, tuple[int, ...]] | None = None
        with self._lock:
            for key, (spans, toks) in self._entries.items():
                if (len(key) < len(raw) and (best is None or len(key) > len(best[0])) and raw.startswith(key)
                        and tuple((a, min(b, len(key))) for a, b in plain if a < len(key)) == spans):
                    best = (key, toks)
            if best is not None:
                self._entries.move_to_end(best[0])
                self.hits += 1
        if best is None:
            return tokenize_rendered(self.model, text)
        return list(best[1]) + tokenize_rendered(self.model, text[len(best[0]):], start=False)

    def remember(self, text, tokens, answer: str, answer_tokens) -> bool:
        """Keep ``text`` + ``answer`` with ``tokens`` + ``answer_tokens`` (the rendering a request was
        tokenized from and its tokens; an answer whose tokens the cache holds, i.e. one that finished
        by ``eos`` or ``length``, its text exactly their pieces). Returns whether it was kept."""
        from .templates import _special_text

        answer_tokens = [int(t) for t in answer_tokens]
        if not answer_tokens or any(_special_text(self.model, t) is not None for t in answer_tokens):
            return False   # a control token in the answer (or nothing to keep)
        key = str.__str__(text) + answer
        if len(key) > self.max_chars:
            return False
        spans = tuple(getattr(text, "plain", ()))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._chars -= len(key)
            self._entries[key] = (spans, tuple(int(t) for t in tokens) + tuple(answer_tokens))
            self._chars += len(key)
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                k, _ = self._entries.popitem(last=False)
                self._chars -= len(k)
        return True
