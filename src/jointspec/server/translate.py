"""What the routes of other APIs share (OpenAI's Responses API in server/responses.py, Anthropic's Messages API in
server/anthropic.py): each reads its request into a chat request (:class:`ChatRequest`), the chat route decodes it,
and a shaper (:class:`ChunkShaper`) writes the chat route's streamed chunks back in the API's own events.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

# A chat message named in an error: its index, and a call or a call id inside it.
_MESSAGE = re.compile(r"\bmessages\.(\d+)((?:\.tool_calls\.\d+)?(?:\.tool_call_id)?)")


class TranslationError(ValueError):
    """Another API's request that cannot be served; ``param`` names its field as that API names it."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class ChatRequest:
    """A request of another API as the chat request that decodes it: its body, where each of its messages came from
    (``instructions``, ``input.N``, ``system``, ``messages.N``), so that an error about a message names what the
    client sent, and the other API's names for the chat's fields (``renames``: pattern, replacement)."""

    body: dict
    origins: tuple[str, ...]
    renames: tuple[tuple[re.Pattern, str], ...]
    # What a tool result's call id is called where the message came from.
    call_id: str
    # The messages a later request may continue (the Responses API's stored responses): the body's, less its
    # instructions; the first ``continued`` of them are those of the stored response it continued.
    conversation: tuple[dict, ...] = ()
    continued: int = 0

    def wording(self, text: str | None) -> str | None:
        """An error's field name or message as the other API's request names its fields."""
        if text is None:
            return None

        def item(match: re.Match) -> str:
            index = int(match.group(1))
            if index >= len(self.origins):
                return match.group(0)
            return self.origins[index] + (self.call_id if match.group(2).endswith("tool_call_id") else "")

        text = _MESSAGE.sub(item, text)
        for pattern, name in self.renames:
            text = pattern.sub(name, text)
        return text


class ChunkShaper(ABC):
    """Reads the chat route's streamed chunks for an API's events: an error ends the stream (:meth:`failed`), the
    usage chunk is kept for the last events (:attr:`usage`, in the API's terms: :meth:`usage_of`), and each choice's
    delta and finish go to :meth:`choice`."""

    usage: dict | None = None

    def events(self, chunk: dict) -> list[str]:
        """The events of one streamed chat chunk (the chat route's payload)."""
        if "error" in chunk:
            return self.failed(chunk["error"])
        if chunk.get("usage") is not None and not chunk.get("choices"):
            self.usage = self.usage_of(chunk["usage"])
            return []
        return [event for choice in chunk.get("choices", []) for event in self.choice(choice)]

    @abstractmethod
    def failed(self, error: dict) -> list[str]:
        """The events that end a stream the chat route ended with ``error`` (its envelope's ``error``)."""

    @staticmethod
    @abstractmethod
    def usage_of(usage: dict) -> dict:
        """Chat's usage in the API's terms."""

    @abstractmethod
    def choice(self, choice: dict) -> list[str]:
        """The events of one streamed choice: its delta, and its finish where it has one."""
