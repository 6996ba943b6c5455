"""The canary records' front objects (SPEC 4): :mod:`.api` launches write / verify / scatter
(:class:`~canary.CanaryRecords`, ``scatter_expected_tokens``), :mod:`.layers` the layer rotation
(:class:`~canary.CanaryLayers`) and :mod:`.move` records that move with the KV (:class:`~canary.RecordMover`).
The formats they read and write (state, ring, real-KV sources, hashes) are the contract's: :mod:`canary.contract`.
"""
