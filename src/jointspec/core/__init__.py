"""Core types and the one decode loop: drafts, verdicts, sampling, errors. Depends on nothing else in jointspec."""
