"""The ``jointspec`` command: ``main`` builds the parser, one module per subcommand group."""
