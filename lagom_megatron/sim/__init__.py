"""A calibrated GPU-cluster simulator that the whole ``--lagom`` lifecycle runs against.

``device`` (kernels and collectives on one GPU), ``workload_shape`` and ``workload`` (one
Megatron iteration of a representative rank), ``timeline`` (streams sharing SMs and HBM), ``backend`` (the simulated
backend and ``run_lifecycle``), ``bench`` (``lagom bench simulated``). The engine never imports
this package; the search only sees the profile records the backend reports. docs/simulator.md.
"""
