"""The tiered KV cache's worker side: the offloading connector (``connector.py``), unit copies
(``copies.py``), the disk tier and its files (``disk_tier.py``, ``unit_file.py``), and its
construction with the start-up cost measurement (``build.py``)."""
