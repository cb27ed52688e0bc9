"""Starting services on one machine: nats-server (``nats_server``), a whole stack
(``stack``) and each service's share of the extra flags (``service_flags``).

Used by ``scripts/serve``, the benchmarks and the end-to-end tests; no service imports it.
"""
