"""The NumPy reference backend: the executable form of SPEC 3 (``plan``) and SPEC 4 (``records``); every GPU
backend is tested byte for byte against it. Host arrays only; nothing beyond NumPy."""
