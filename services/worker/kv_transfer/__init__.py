"""The KV connector's worker role (P/D disaggregation): ``block_io.py`` reads and writes
whole KV blocks of the paged cache as bytes, ``chunks.py`` splits a transfer into chunks
under the bus's payload limit, ``connector.py`` serves held blocks and pulls others'."""
