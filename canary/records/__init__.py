"""The canary records (SPEC 4): the per-slot records that write and verify keep beside the KV cache.

:mod:`.api` launches write / verify / scatter (:class:`~canary.CanaryRecords`, ``scatter_expected_tokens``),
:mod:`.state` holds the device state (canary buffer, violation ring, counters, flags), :mod:`.ring` defines
the record and ring formats and decodes violations, :mod:`.realkv` says which KV bytes a record hashes, and
:mod:`.hashes` defines the hash functions.
"""
