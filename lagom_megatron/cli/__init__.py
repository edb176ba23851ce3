"""The ``lagom`` command: ``main.py`` dispatches to one module per subcommand."""
