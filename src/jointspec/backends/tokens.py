"""Tokenizer helpers every backend and front end shares: which ids end a sequence, and streaming detokenisation."""

from __future__ import annotations

import json
import re

from jointspec.backends.hf import CausalLM


def eos_token_ids(model: CausalLM, tokenizer) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_eos = getattr(getattr(getattr(model, "model", None), "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(int(i) for i in generation_eos)
    return frozenset(ids)


def decode_text(tokenizer, token_ids: list[int], kept: dict[int, str] | None = None) -> str:
    """The text of generated ``token_ids``, as every front end shows it: special tokens skipped and no clean-up of
    spaces. Clean-up (``clean_up_tokenization_spaces``, which some tokenizers turn on) rewrites text before a later
    token (" '" then "m" becomes "'m"), so a stream that had sent the earlier text could not show what a whole decode
    shows; without it a decode of more tokens extends a decode of fewer. ``kept``: special tokens spelled out all the
    same (id: spelling; a tool-call format's markers), the text between them decoded as above, each run alone."""
    if kept and not kept.keys().isdisjoint(token_ids):
        pieces, run = [], []
        for token_id in token_ids:
            if token_id in kept:
                pieces += [decode_text(tokenizer, run), kept[token_id]]
                run = []
            else:
                run.append(token_id)
        return "".join(pieces) + decode_text(tokenizer, run)
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except TypeError:  # a tokenizer whose decode takes no such option (not transformers') has no clean-up either
        return tokenizer.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 characters; the deltas and
    :meth:`finish` add up to :func:`decode_text` of every id pushed.

    Each push decodes a window, not the whole answer: the tokens whose text it last sent and the new ones, their
    delta being what the new ones add to the window's text. Decoding everything at every push made an answer of n
    tokens cost n^2 (a long reasoning answer spent longer decoding its text than its tokens). The window starts where
    a text was last sent whole, so the new tokens decode as in the whole text: a SentencePiece word keeps the space
    its marker spells (a decode drops it only from the window's first token, whose text is not sent again), and a
    character split across byte tokens joins."""

    def __init__(self, tokenizer, context: list[int] | None = None, kept: dict[int, str] | None = None) -> None:
        """``context``: ids the text follows but does not include (an echoed prompt): decoded with them, the deltas
        are what the ids add to the context's text (a SentencePiece answer's first space included, which a decode
        of the answer alone drops). ``kept``: special tokens the text spells out (:func:`decode_text`)."""
        self.tokenizer = tokenizer
        self.kept = kept
        self.special = set(getattr(tokenizer, "all_special_ids", ()) or ()) - set(kept or ())
        self.skips: dict[int, bool] = {}
        self.token_ids: list[int] = list(context or ())
        # The window: token_ids[start:read] are the tokens whose text was last sent (a few of the context's at first,
        # from a character's start: SentencePiece's byte fallback reads a run of byte tokens begun inside a character
        # as a U+FFFD a byte, the answer's own bytes after it too).
        self.read = len(self.token_ids)
        self.start = max(0, self.read - CONTEXT_WINDOW)
        while self.start and decode_text(tokenizer, self.token_ids[self.start:self.read], kept).startswith("\ufffd"):
            self.start -= 1

    def push(self, token_ids: list[int]) -> str:
        # Special tokens a decode skips are left out: they change no text, and a run of them (a broken model writing
        # its pad token on and on) would otherwise stay in every later window.
        self.token_ids.extend(token for token in token_ids if not self._skipped(token))
        return self._advance(final=False)

    def _skipped(self, token: int) -> bool:
        """Whether a decode skips ``token`` wherever it stands: a special token that is not kept."""
        if token not in self.skips:
            self.skips[token] = token in self.special and not decode_text(self.tokenizer, [token], self.kept) and bool(
                self.tokenizer.decode([token], skip_special_tokens=False))
        return self.skips[token]

    def finish(self) -> str:
        """The held-back rest at the end: bytes no later token completes show as U+FFFD, as a whole decode shows
        them."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = decode_text(self.tokenizer, self.token_ids[self.start:self.read], self.kept)
        text = decode_text(self.tokenizer, self.token_ids[self.start:], self.kept)
        if text.endswith("\ufffd") and not final:
            return ""  # a multi-byte character is split across tokens: wait for the rest
        # (what lies past the window's old text: where a later token rewrote it, as SentencePiece's byte fallback
        # does, text already sent is not sent again)
        delta = text[len(before):]
        if delta:
            self.start, self.read = self.read, len(self.token_ids)
        return delta


# How many of a context's last tokens the first push decodes with the answer's (enough for a word's marker and a
# character's bytes).
CONTEXT_WINDOW = 8


def _special_spellings(tokenizer) -> list[str]:
    """The text of every special token the tokenizer would read out of a string (``<|im_end|>``)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    spellings = {token.content for token in added.values() if getattr(token, "special", False)}
    spellings.update(getattr(tokenizer, "all_special_tokens", ()) or ())
    return [spelling for spelling in spellings if spelling]


# A message's fields that hold text read as text (chat_template_ids): its content, and an assistant's reasoning (as
# gpt-oss's template reads it, ``thinking``).
MESSAGE_TEXTS = ("content", "reasoning_content", "thinking")
# A message's text the template is given after its content as the template's own, special tokens read as tokens: what
# the server writes itself (an earlier turn's calls in the model's format, where the template drops them), never a
# client's text.
TEMPLATE_TAIL = "template_tail"
# What further template variables (chat_template_ids' template_kwargs, vLLM's chat_template_kwargs) may not name:
# the conversation and tools rendered from the messages, and the arguments of transformers' apply_chat_template
# itself (the output's form).
TEMPLATE_CALL_NAMES = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def check_template_kwargs(kwargs) -> dict:
    """``kwargs`` as further chat template variables: an object whose names the template call does not take itself
    (ValueError naming them)."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat template variables must be a JSON object such as {{\"enable_thinking\": false}}, got "
                         f"{json.dumps(kwargs)}")
    if any(not isinstance(name, str) for name in kwargs):
        raise ValueError("chat template variables are named by text")
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError):
        raise ValueError("chat template variables must be JSON values (text, numbers, true/false, null, lists, "
                         "objects)") from None
    taken = sorted(set(kwargs) & TEMPLATE_CALL_NAMES)
    if taken:
        raise ValueError(f"chat template variables may not set {', '.join(taken)}: the chat template call sets them "
                         "itself")
    return kwargs


def chat_template_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                      template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
    """``messages`` in the tokenizer's chat template, with the assistant's turn opened, as token ids.

    A message's text (its content, and an assistant's ``reasoning_content`` sent back) is read as text: a special
    token's spelling inside it (``<|im_end|>``) stays characters, as OpenAI's API reads message content, so it cannot
    close its turn and open another (a user writing a system turn); the template's own markers are the special
    tokens. A conversation without such spellings reads exactly as the rendered text does. Raises ValueError where
    the template repeats a text (then its copies cannot be told from the template's); a text the template does not
    render is not looked for. ``tools`` (OpenAI's form) go to a template that renders them; their
    text, and that of the calls in ``messages``, may hold no special token's spelling (ValueError).
    ``template_kwargs``: further variables the template reads (``enable_thinking``), as vLLM's
    ``chat_template_kwargs``; their text may hold no special token's spelling either. ``continue_final``: the last
    message (an assistant's) is continued, not closed (a prefill: the answer goes on from its text). A message's
    :data:`TEMPLATE_TAIL` follows its content as the template's own text."""
    extra = dict(template_kwargs or {})
    if continue_final:
        extra.update(continue_final_message=True, add_generation_prompt=False)
    tails = {index: message[TEMPLATE_TAIL] for index, message in enumerate(messages) if message.get(TEMPLATE_TAIL)}
    messages = [{key: value for key, value in message.items() if key != TEMPLATE_TAIL} for message in messages]

    def tailed(given: list[dict]) -> list[dict]:  # (each tail after its message's content, as the template's text)
        return [{**message, "content": (message.get("content") or "") + tails[index]} if index in tails else message
                for index, message in enumerate(given)]

    text = _render(tokenizer, tailed(messages), tools, extra)
    special = _special_spellings(tokenizer)
    rendered_as_is = json.dumps([tools, [message.get("tool_calls") for message in messages], extra],
                                ensure_ascii=False)
    if any(spelling in rendered_as_is for spelling in special):
        raise ValueError("a tool, a tool call or a chat_template_kwargs value holds a special token's text (such as "
                         "<|im_end|>), which the chat template would read as that token: remove it")
    # The texts read as text: each message's content, and an assistant's earlier reasoning sent back.
    texts = {(index, key): message[key] for index, message in enumerate(messages) for key in MESSAGE_TEXTS
             if isinstance(message.get(key), str) and message[key]}
    if not any(spelling in text for text in texts.values() for spelling in special):
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    # Each text replaced by a marker (private-use characters), the template rendered around the markers, then read
    # piece by piece: the template's pieces with their special tokens, the texts as plain text. An empty text keeps
    # no marker: a template may render an empty message otherwise (an assistant turn holding only tool calls). A
    # text the template does not render (earlier reasoning it drops, a call turn's text) has no marker in its output.
    markers = {field: f"\ue000{number}\ue001" for number, field in enumerate(texts)}
    marked = _render(tokenizer, tailed([{**message, **{key: markers[(index, key)] for key in MESSAGE_TEXTS
                                                       if (index, key) in markers}}
                                        for index, message in enumerate(messages)]), tools, extra)
    found = []
    for field, marker in markers.items():
        count = marked.count(marker)
        if count > 1:
            raise ValueError("a message holds a special token's text (such as <|im_end|>), and this model's chat "
                             "template repeats message text, so it cannot be read as plain text: remove it from the "
                             "message")
        if count:
            found.append((marked.index(marker), marker, texts[field]))
    ids: list[int] = []
    at = 0
    for position, marker, given in sorted(found):
        if position > at:
            ids += tokenizer(marked[at:position], add_special_tokens=False)["input_ids"]
        ids += tokenizer(given, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        at = position + len(marker)
    if marked[at:]:
        ids += tokenizer(marked[at:], add_special_tokens=False)["input_ids"]
    return ids


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, extra: dict) -> str:
    """The chat template's text for ``messages``, the assistant's turn opened (or, with ``continue_final_message``
    among ``extra``, the last message's left open). A conversation the template refuses
    (its ``raise_exception``: roles that do not alternate, a system message it does not take) is a ValueError that
    says so, naming ``messages`` (``param``): the conversation's fault, not the server's."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             **{"add_generation_prompt": True, **extra})
    except jinja2.TemplateSyntaxError:
        raise  # (the template itself is broken: not the conversation's fault)
    except jinja2.TemplateError as error:
        refused = ValueError(f"the model's chat template refused the conversation: {error}")
        refused.param = "messages"
        raise refused from None
    except RecursionError:
        raise ValueError("the conversation, its tools or chat_template_kwargs are nested too deeply for the chat "
                         "template") from None
    except TypeError as error:
        if not extra:
            raise
        # (a name the template call or the template itself uses for something else: namespace, conversations)
        refused = ValueError(f"chat_template_kwargs cannot be given to the chat template: {error}")
        refused.param = "chat_template_kwargs"
        raise refused from None


class TokenSpelling:
    """Each token's own UTF-8 bytes and text, as OpenAI's log-probabilities list them (``bytes`` and ``token``).

    A token may hold part of a character (byte-level BPE splits multi-byte characters; SentencePiece falls back to
    ``<0xE2>`` byte tokens): its bytes are then exact and its text is written as OpenAI's API writes such a token,
    ``bytes:`` and the bytes escaped (``bytes:\\xe6\\x97``), so that no two tokens share a text. Read from the
    tokenizer's own pieces, not by decoding the token alone, which drops a SentencePiece piece's leading space and
    cannot give a partial character's bytes."""

    _BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = None
        if decoder is not None and "ByteLevel" in repr(decoder):  # (inside a Sequence too)
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_level = {char: byte for byte, char in bytes_to_unicode().items()}
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._known: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of ``token_id``."""
        token_id = int(token_id)
        if token_id not in self._known:
            data = self._bytes(token_id)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)
            self._known[token_id] = (text, data)
        return self._known[token_id]

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (an end of sequence, say), which answer text leaves out."""
        return int(token_id) in self._special

    def starts_text_without_its_space(self, token_id: int) -> bool:
        """Whether a text that begins with ``token_id`` drops the space its bytes begin with (a SentencePiece word
        marker, which the tokenizer's decoder strips at the start of a text): where it begins an answer, its text
        then starts one character later than its bytes say."""
        data = self(token_id)[1]
        if not data.startswith(b" ") or self.is_special(token_id):
            return False
        return not decode_text(self.tokenizer, [int(token_id)]).startswith(" ")

    def _bytes(self, token_id: int) -> bytes:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except (IndexError, KeyError, OverflowError, TypeError):  # an id past the tokenizer (a padded head)
            piece = None
        if piece is None:
            return b""
        if token_id in self._special:
            return piece.encode("utf-8")
        if self._byte_level is not None and all(char in self._byte_level for char in piece):
            return bytes(self._byte_level[char] for char in piece)
        byte = self._BYTE_TOKEN.fullmatch(piece)
        if byte:
            return bytes([int(byte[1], 16)])
        if "\u2581" in piece:  # SentencePiece's word marker stands for a space
            return piece.replace("\u2581", " ").encode("utf-8")
        try:
            return self.tokenizer.decode([token_id], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False).encode("utf-8")
        except TypeError:
            return self.tokenizer.decode([token_id]).encode("utf-8")
