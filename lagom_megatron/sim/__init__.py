"""A GPU-cluster simulator the ``--lagom`` lifecycle runs against; the engine never imports it (docs/simulator.md)."""
