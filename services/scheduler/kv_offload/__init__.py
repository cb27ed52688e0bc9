"""The tiered KV cache's scheduler side: the offloading connector (``connector.py``), its index
of the host tier (``host_index.py``) and its look at the disk tier (``disk_probe.py``)."""
