"""Planning's front object (SPEC 3): the planner and SGLang's one-shot entry point (:mod:`.planner`). The plan
buffers and the per-row rules are the contract's (:mod:`canary.contract.plans`, :mod:`canary.contract.rows`)."""
