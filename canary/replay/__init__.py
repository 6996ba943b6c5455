"""The replay application (``kv-canary replay``): a continuous-batching scheduler simulator over a real
serving trace (:mod:`.scheduler`), a simulated engine with a paged KV pool (:mod:`.engine`), injectable faults
(:mod:`.faults`), the engine as a :class:`canary.CanaryManager` client and the attribution of its violations
(:mod:`.replay_manager`), verify coverage (:mod:`.coverage`), the replay driver (:mod:`.replay`), its options
(:mod:`.options`) and tables (:mod:`.report`), and the command line (:mod:`.cli`). It uses the library only
through the public API of :mod:`canary` (and the contract, :mod:`canary.contract`); ``import canary`` does
not import it."""
