"""The exceptions jointspec raises at its public boundary.

The CLI turns any :class:`JointspecError` into a one-line message and exit code 2; the server maps each subclass
to an HTTP status. Everything else escaping the library is a bug.
"""

from __future__ import annotations


class JointspecError(Exception):
    """Base class: a user-facing problem with a message that says what to do."""


class ModelLoadError(JointspecError):
    """A model or tokenizer could not be found or loaded."""


class VocabularyMismatchError(JointspecError):
    """A draft and a target do not share a tokenizer/vocabulary."""


class ContextTooLongError(JointspecError):
    """The prompt (plus what is asked for) does not fit the model's context window."""

    @classmethod
    def for_prompt(cls, num_prompt_tokens: int, max_context: int) -> ContextTooLongError:
        """A prompt that leaves no room for the first new token."""
        return cls(f"the prompt has {num_prompt_tokens} tokens but the model's context holds {max_context}, one of "
                   f"them for the first new token; shorten the prompt to at most {max_context - 1} tokens")


class UnsupportedOptionError(JointspecError):
    """An option, method or combination the library does not support."""
