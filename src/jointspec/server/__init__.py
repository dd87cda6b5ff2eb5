"""An OpenAI-compatible server over the batched engine: ``app`` (routes), ``engine`` (glue), ``metrics``; the
command is ``jointspec.cli.serve``."""
