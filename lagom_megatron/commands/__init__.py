"""Subcommands of the ``lagom`` command, one module each (see ``lagom_megatron.cli``)."""
