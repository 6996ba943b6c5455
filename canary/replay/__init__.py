"""The replay application (``kv-canary replay``): a continuous-batching scheduler simulator over a real
serving trace (:mod:`.scheduler`), a simulated engine with a paged KV pool (:mod:`.engine`), injectable faults
(:mod:`.faults`), the replay driver (:mod:`.replay`, :mod:`.replay_records`) and the command line
(:mod:`.cli`). It uses the library only through the public API of :mod:`canary`; ``import canary`` does not
import it."""
