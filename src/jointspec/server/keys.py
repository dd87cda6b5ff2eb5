"""The API key a server asks for and a client sends (``Authorization: Bearer KEY``): where it comes from and what a
key may be. Apart from the routes so that clients (``train-draft --answers-from``) use it without the serve extra."""

from __future__ import annotations

import re

API_KEY_VARIABLE = "JOINTSPEC_API_KEY"
API_KEY_RULE = "an API key is printable ASCII without spaces (what an HTTP header carries whole)"


def valid_api_key(key: str) -> bool:
    """Whether ``key`` can be sent and compared as it is: printable ASCII characters, no space. A header's value
    loses its outer spaces on the way, and clients encode other characters each their own way (or not at all)."""
    return re.fullmatch(r"[\x21-\x7e]+", key) is not None
