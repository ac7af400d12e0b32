"""Side-by-side benchmark of resilient_ckpt against Megatron-core + nvidia-resiliency-ext.

``resilient-ckpt bench`` runs :func:`resilient_ckpt.bench.main.main`. Modules:
:mod:`.workload` (the Megatron-like state dict), :mod:`.limits` (the machine's bandwidths),
:mod:`.baseline` (the system we are measured against), :mod:`.launcher` (rank processes,
shared by the runner and the limits), :mod:`.runner` (phases, configurations, the
:class:`~.runner.System` interface), :mod:`.main` (the command line: flags, the run plan,
every configuration, the JSON document), :mod:`.report` (tables, JSON, plot).
``resilient-ckpt bench --control-plane`` runs :func:`resilient_ckpt.bench.control_plane.main`
(the package :mod:`.control_plane`: workload, phase profiler, real ranks, simulated world
sizes, report).

Nothing heavy is imported here: rank processes import only what their phase needs.
"""
