"""How caller arrays and streams reach the kernels: zero-copy views (:mod:`.adapter`), streams (:mod:`.streams`),
the optional array libraries (:mod:`.libs`), device allocation (:mod:`.devices`) and host copies
(:mod:`.hostcopy`). Nothing here imports CuPy, Numba or torch at import time."""
