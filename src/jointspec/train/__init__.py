"""Training drafts for a given target: self-distillation data, prompt sources, the kinds of draft and their
trainers (the ``train-draft`` command is jointspec.cli.train)."""
