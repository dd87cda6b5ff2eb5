"""Training drafters for a given target: self-distillation data, feature-level heads, the ``train-draft`` command."""
