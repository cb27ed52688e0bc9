"""The tiered KV cache's worker side: the offloading connector (``connector.py``), unit copies
(``copies.py``), the disk tier (``disk_tier.py``; its files' format is ``shared/kv_unit_file.py``), and its
construction with the start-up cost measurement (``build.py``)."""
