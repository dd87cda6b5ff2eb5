"""``jointspec bench``: a Spec-Bench-style benchmark of every method against a baseline, in one process.

prompts.py reads MT-Bench/Spec-Bench JSONL; specs.py parses ``name:key=value`` method specs; engines.py runs a
method (jointspec's loop or transformers' generate); runner.py times them prompt-major; costmodel.py measures the
target's cost T(k) and predicts each method's speed; report.py aggregates and writes the table, JSON and plots;
cli.py is the subcommand.
"""
