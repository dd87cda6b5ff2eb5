"""Decoding methods: each name builds a (drafter, verifier) pair for the one loop. ``registry`` holds the names;
``lossless`` the chain and tree methods over lookup, draft models and heads; ``trees`` SpecInfer and SpecTr;
``lookahead`` Lookahead's trie drafts and lookahead decoding (``lade``); ``aded`` ADED's adaptive tri-gram drafts;
``cross_tokenizer`` a draft model with another tokenizer (``cross``);
``mtad`` multi-token assisted decoding; ``default`` the policy ``jointspec generate`` runs; ``oracle`` a drafter that
knows the answer (for measuring the loop); ``sparse_self`` TriForce-style self-speculation for long inputs.
Importing this package registers them all.
"""

from jointspec.methods import aded, cross_tokenizer, default, lookahead, lossless, mtad, oracle, sparse_self, trees
from jointspec.methods.registry import (
                                        MethodConfig,
                                        MethodContext,
                                        build_method,
                                        lossless_methods,
                                        method_names,
                                        method_summaries,
                                        online_methods,
                                        register_method,
)

# The modules are listed too: importing each registers its methods.
__all__ = ["aded", "cross_tokenizer", "default", "lookahead", "lossless", "mtad", "oracle", "sparse_self", "trees",
           "MethodConfig", "MethodContext", "build_method", "lossless_methods", "method_names", "method_summaries",
           "online_methods", "register_method"]
