"""Method specs for `jointspec bench --methods` (``jointspec.bench.specs``): splitting, option aliases and types, and
one clear error for every malformed spec. Deterministic: no false-failure odds.
"""

from __future__ import annotations

import pytest

from jointspec.bench.specs import MethodSpecError, method_config, parse_spec, parse_specs, split_specs
from jointspec.methods import MethodConfig


def test_spec_parsing():
    assert split_specs("ar,pld:n=4,max_ngram=2,hf-pld,mtad-like:tree=4,2,2") == [
        "ar", "pld:n=4,max_ngram=2", "hf-pld", "mtad-like:tree=4,2,2"]
    spec = parse_spec("pld:n=4,ngram=2")
    assert spec.options == {"num_draft_tokens": "4", "max_ngram": "2"}
    config = method_config(spec, MethodConfig(max_ngram=3, min_ngram=1))
    assert (config.name, config.num_draft_tokens, config.max_ngram) == ("pld", 4, 2)
    oracle = method_config(parse_spec("oracle:corrupt=0.25,k=3"), MethodConfig())
    assert (oracle.corruption_rate, oracle.num_draft_tokens) == (0.25, 3)
    assert parse_spec("hf-assisted:draft=self,n=3").options == {"draft": "self", "num_draft_tokens": "3"}
    # A tree is a tuple of widths even though its default (None: the method's own tree) says no type.
    assert method_config(parse_spec("specinfer:tree=3,1"), MethodConfig()).tree == (3, 1)
    assert method_config(parse_spec("hybrid-tree:tree=2x2"), MethodConfig()).tree == (2, 2)
    assert method_config(parse_spec("default:tree_budget=3"), MethodConfig()).tree_budget == 3
    # The command line's name for the longest draft works as a key too (--max-draft-tokens).
    assert method_config(parse_spec("pld:max_draft_tokens=8"), MethodConfig()).max_num_draft_tokens == 8


@pytest.mark.parametrize("text,message", [
    ("nope", "unknown method 'nope'.*choose one of: .*ar.*hf-generate.*pld"),
    ("pld:bogus=1", "unknown option 'bogus' for method 'pld'; valid options: .*num_draft_tokens"),
    ("pld:beams=4", "unknown option 'beams' for method 'pld'; valid options: .*num_draft_tokens"),  # one it ignores
    ("ar:draft=self", "unknown option 'draft' for method 'ar'; valid options: backend"),
    ("hf-pld:draft=x", "unknown option 'draft' for method 'hf-pld'; valid options: num_draft_tokens, max_ngram"),
    ("pld:n", "must be key=value"),
    ("ar,ar", "listed twice"),
])
def test_bad_specs(text, message):
    with pytest.raises(MethodSpecError, match=message):
        parse_specs(text)


@pytest.mark.parametrize("text,message", [("pld:n=four", "must be int"), ("pld:n=0", "num_draft_tokens must be")])
def test_bad_option_values(text, message):
    with pytest.raises(MethodSpecError, match=message):
        method_config(parse_spec(text), MethodConfig())
