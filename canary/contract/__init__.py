"""The contract: the bytes both sides of a kernel boundary agree on (SPEC 2-4), and nothing that launches.

Floor 2 of the package (``errors`` < ``interop`` < ``contract`` < ``backends`` < ``plan`` / ``records`` <
``manager`` < ``replay``; ``tests/usage/test_layout.py`` enforces it). Every backend and every front object
reads these definitions; none of them is defined twice.

- :mod:`.plans`: the verify and write plan buffers (:class:`VerifyPlan`, :class:`WritePlan`), their
  sentinels (``SKIP_SEED``, ``MISSING_SLOT``) and the host rules on them (``mark_missing``, ``translate``).
- :mod:`.rows`: the per-row input rules the planner and the reference share (SPEC 3.2).
- :mod:`.ring`: the record and violation-ring formats, kernel tags and their decoding.
- :mod:`.state`: the device state (canary buffer, ring, counters, flags): :class:`CanaryState`.
- :mod:`.realkv`: which KV bytes a record hashes (:class:`RealKV`, ``real_kv``, ``real_kv_source``).
- :mod:`.hashes`: the hash functions (SPEC 4).
- :mod:`.plan_layout`, :mod:`.records_layout`, :mod:`.layers_layout`, :mod:`.move_layout`: the launch-parameter
  structs (declared once through :mod:`.cstruct`) and grid rules shared with ``kernels/``; :mod:`.move_layout`
  also the row format and status word of records that move (SPEC 4.1).
- :mod:`.kernel_constants`: every constant both sides of a kernel boundary use, gathered from the modules above
  under the kernels' names; ``python -m canary.contract.kernel_constants`` writes ``kernels/canary_constants.cuh``,
  which the ``.cu`` files include, and the Numba twins import the same names.
"""
