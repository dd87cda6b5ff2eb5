"""``jointspec bench``: a Spec-Bench-style benchmark of every method against a baseline, in one process.

prompts.py reads MT-Bench/Spec-Bench JSONL; specs.py parses ``name:key=value`` method specs; engines.py runs a
method (jointspec's loop or transformers' generate); runner.py times them prompt-major; costmodel.py measures the
target's cost T(k) and predicts each method's speed; intervals.py holds the paired bootstrap; report.py aggregates
and writes the table, JSON and plots; energy.py reads energy meters. compare.py (``bench-intervals``),
head_agreement.py (``head-agreement``) and corpus_replay.py (``corpus-replay``) analyse finished runs and drafts.
The commands themselves live in jointspec.cli.
"""
