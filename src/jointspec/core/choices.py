"""The values of options that several entry points share (the CLI, bench specs, server requests, the Python API).

This module imports nothing, so that building the CLI's parser (``jointspec --help``, every subcommand's options)
names the choices without importing torch or transformers, which takes seconds. Each choice is explained where it is
used; the modules that use them re-export them under the same names.
"""

# How a method may verify (``MethodConfig.verify``): chains with draft rows token-wise or as a block, sampled trees
# by recursive rejection ("token") or by traversal (core/verdict.py).
VERIFY_CHOICES = ("token", "block", "traversal")

# Methods whose ``tree_budget`` grows a dynamic (EAGLE-2) tree, which drafts for greedy decoding only.
DYNAMIC_TREE_METHODS = ("hybrid-tree", "default")


def dynamic_tree_refusal(method: str, tree_budget: int, temperature: float) -> str | None:
    """Why a dynamic tree cannot serve this request (sampling), or None: the CLI and the batched engines refuse it
    before decoding, rather than the drafter after the first tokens are out."""
    if method in DYNAMIC_TREE_METHODS and tree_budget and temperature > 0:
        return (f"{method}: --tree-budget drafts for greedy decoding only, not at --temperature {temperature:g}; for "
                "sampling, give a static tree with --tree")
    return None


# Weights of a trained head's linears (drafts/artifact.py).
HEAD_WEIGHT_CHOICES = ("auto", "float32", "int8")

# What runs the models (backends/loading.py).
BACKENDS = ("torch", "llamacpp")

# Weight quantisation at load (kernels/quantize.py); ``auto``: int4 where that is the model itself, else none.
QUANTIZE_MODES = ("none", "int8", "int4")
QUANTIZE_CHOICES = ("auto", *QUANTIZE_MODES)

# A float32 model's linear and attention kernels on the CPU (kernels/fp32.py).
KERNEL_CHOICES = ("auto", "onednn", "stock")

# What the target's KV cache stores (backends/loading.py).
KV_CACHE_CHOICES = ("auto", "float32", "float16")
