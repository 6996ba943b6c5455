"""Engine integrations built on the public API: each one switches the canary on inside an engine in one call.

- :mod:`canary.integrations.transformers`: Hugging Face transformers' continuous batching
  (``enable(model_or_manager)``; docs/integrations/transformers.md).

Nothing here is imported by ``import canary``; an integration imports its engine (and torch) only when enabled.
"""
